"""The layout's rules that the writing side (workers, stacks) and the reading side (reader, validate,
compare) both need, each stated once.

- Rows: a batch row is a padded sequence or a packed (THD) row of documents (`BatchRow`).
- DP: each DP rank takes a contiguous, equal share of the rows (`dp_rows`).
- CP split: each CP rank holds two zigzag chunks (of 2*cp) of every piece the row is cut into: of
  every document of a packed row split document by document, else of the whole row
  (`cp_split_bounds`, `cp_bounds`, `cp_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# How a packed row was split over CP ranks (dump.json's cp_split): "document", every document
# zigzagged on its own (TE's THD split); "row", the row zigzagged as one sequence (the classic bug).
CP_SPLITS = ("document", "row")


@dataclass(frozen=True)
class BatchRow:
    """One row of the batch as the model saw it: where its documents start and end once padded
    (`bounds`, from 0 to the row's length) and how many real tokens each holds (`lengths`). A padded
    batch has one document a row; a packed (THD) row holds several, back to back."""

    bounds: tuple[int, ...]
    lengths: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "lengths": list(self.lengths)}


def dp_rows(rows: int, dp: int, dp_rank: int) -> slice:
    """The rows of the batch (or sequences, before packing) a DP rank takes: its contiguous, equal
    share, in dp_rank order (Layout.check_sequences makes dp divide them)."""
    per_rank = rows // dp
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def cp_split_bounds(row: BatchRow, cp_split: str = "document") -> tuple[int, ...]:
    """Where a row is cut before each piece is zigzagged over the CP ranks: at its documents' bounds
    ("document"), or only at its ends ("row"). A padded row is one document: both give (0, length)."""
    return tuple(row.bounds) if cp_split == "document" else (0, row.bounds[-1])


def cp_bounds(documents: Optional[Sequence[int]], local_len: int, cp_size: int) -> tuple[int, ...]:
    """The bounds a CP rank's `local_len` positions of a row were cut at: `documents` where the row
    was split document by document, or (None) the whole row, which is local_len * cp_size long."""
    return tuple(documents) if documents else (0, local_len * cp_size)


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2*cp_size) that megatron's get_batch_on_this_cp_rank gives a CP rank."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(bounds: Sequence[int], cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Positions of a row that a CP rank holds, in its local order: every document (bounds[i] to
    bounds[i+1]) cut into 2*cp_size chunks, the rank taking its two zigzag chunks of each. With one
    document this is megatron's zigzag; with several, TE's thd_get_partitioned_indices."""
    if cp_size == 1:
        return torch.arange(bounds[0], bounds[-1], device=device)  # documents of any length, uncut
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        for c in zigzag_chunks(cp_rank, cp_size):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk, device=device))
    return torch.cat(pieces)


def zigzag_positions(local_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global sequence positions held by a CP rank of an unpacked sequence, in its local order."""
    return cp_positions(cp_bounds(None, local_len, cp_size), cp_rank, cp_size, device=device)
