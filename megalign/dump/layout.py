"""The layout's rules that the writing side (workers, stacks) and the reading side (reader, validate,
compare) both need, each stated once.

- Layout: how the world is split (tp, pp, cp, dp, sp, ep, etp), its sizes and its share of the rows
  checked, and how it prints (`Layout.describe`). A run's spec holds one (spec.RunSpec.layout,
  re-exported there, which checks it against the run's model: spec.check_layout); a dump's reader
  builds one from dump.json (validate.check_layout).
- Rows: a batch row is a padded sequence or a packed (THD) row of documents (`BatchRow`).
- DP: each DP rank takes a contiguous, equal share of the rows (`dp_rows`).
- CP split: each CP rank holds two zigzag chunks (of 2*cp) of every piece the row is cut into: of
  every document of a packed row split document by document, else of the whole row
  (`cp_split_bounds`, `cp_bounds`, `cp_positions`).
- A rank's tokens: its DP rows, its CP chunks, its SP piece of them (`rank_tokens`); the batch's real
  tokens, document after document (`token_index`, `at_real_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megalign.errors import UserError

# How a packed row was split over CP ranks (dump.json's cp_split): "document", every document
# zigzagged on its own (TE's THD split); "row", the row zigzagged as one sequence (the classic bug).
CP_SPLITS = ("document", "row")


@dataclass(frozen=True)
class Layout:
    """How the world is split: world = tp * pp * cp * dp. `sp`: sequence parallelism over the TP ranks."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sp: bool = False
    ep: int = 1  # expert parallelism: the experts split over EP groups carved out of the TP x CP x DP ranks
    etp: Optional[int] = None  # expert tensor parallelism; None: the same as tp (megatron's default)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def packing_multiple(self) -> int:
        """Each packed document is padded to a multiple of this: 2*cp for CP's zigzag, times tp under SP."""
        return (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sp else 1)

    def describe(self) -> str:
        """`tp=2 pp=1 cp=2`, with dp and sp where they are used."""
        return f"tp={self.tp} pp={self.pp} cp={self.cp}" + (f" dp={self.dp}" if self.dp > 1 else "") + \
            (" sp" if self.sp else "") + (f" ep={self.ep}" if self.ep > 1 else "") + \
            (f" etp={self.etp}" if self.etp not in (None, self.tp) else "")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def expert_dp(self) -> int:
        """The smallest --dp that gives EP x ETP enough ranks: they are carved out of TP x CP x DP."""
        need = self.ep * self.expert_tp
        return max(1, need // math.gcd(need, self.tp * self.cp))

    def check_sizes(self) -> None:
        """Every size at least 1: the others are divided by them (expert_dp, the CP split)."""
        for name, size in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("dp", self.dp), ("ep", self.ep),
                           ("etp", self.expert_tp)):
            if size < 1:
                raise UserError(f"--{name} must be at least 1, got {size}")

    def check_sequences(self, sequences: int) -> None:
        if self.dp < 1:
            raise UserError(f"--dp must be at least 1, got {self.dp}")
        if sequences % self.dp:
            raise UserError(f"--dp {self.dp} does not divide the {sequences} sequences (each DP rank takes an equal "
                            "share of them)")


@dataclass(frozen=True)
class BatchRow:
    """One row of the batch as the model saw it: where its documents start and end once padded
    (`bounds`, from 0 to the row's length) and how many real tokens each holds (`lengths`). A padded
    batch has one document a row; a packed (THD) row holds several, back to back."""

    bounds: tuple[int, ...]
    lengths: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "lengths": list(self.lengths)}


def padded_rows(mask: Optional[torch.Tensor], rows: int, length: int) -> tuple[BatchRow, ...]:
    """A padded batch's rows, each one document, from its attention mask [rows, length] (nonzero:
    a real token; each row's real tokens first, the padding after); None: every token real."""
    if mask is None:
        return (BatchRow(bounds=(0, length), lengths=(length,)),) * rows
    if mask.ndim != 2 or tuple(mask.shape) != (rows, length):
        raise UserError(f"attention_mask {list(mask.shape)}: the rows' padding is read from a [batch, seq] mask, "
                        f"here [{rows}, {length}]")
    real = mask.ne(0)
    counts = real.sum(1)
    if not torch.equal(real, torch.arange(length, device=mask.device) < counts[:, None]):
        raise UserError("attention_mask: a row's real tokens do not come first (left padding, or a hole); "
                        "rows are recorded right-padded only")
    return tuple(BatchRow(bounds=(0, length), lengths=(n,)) for n in counts.tolist())


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


def rank_tokens(rows: Sequence[BatchRow], layout: Layout, cp_split: str, tp_rank: int, cp_rank: int, dp_rank: int,
                sp: bool) -> tuple[slice, torch.Tensor]:
    """The tokens of the batch a rank holds of a tensor laid out by tokens: its DP rows, and the
    positions along the sequence in its local order (its CP chunks of the rows, per document in a
    packed row; under `sp`, its TP piece of those). The workers cut by it; run/replay.py puts them back (dump/token_tensor.py)."""
    share = dp_rows(len(rows), layout.dp, dp_rank)
    row = rows[share][0]  # the rows of a DP rank are cut alike: one packed row, or padded ones
    positions = cp_positions(cp_split_bounds(row, cp_split), cp_rank, layout.cp)
    return share, positions.chunk(layout.tp)[tp_rank] if sp else positions


def token_index(rows: Sequence[BatchRow], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) of every real token, document after document."""
    row_index, position = [], []
    for r, row in enumerate(rows):
        for start, length in zip(row.bounds, row.lengths):
            row_index.append(torch.full((length,), r))
            position.append(torch.arange(start, start + length))
    return torch.cat(row_index).to(device), torch.cat(position).to(device)


def at_real_tokens(tensor: torch.Tensor, batch_dim: int, seq_dim: int, rows: Sequence[BatchRow]) -> torch.Tensor:
    """[..., rows, ..., seq, ...] -> [tokens, ...]: the real tokens of every document, in order."""
    row_index, position = token_index(rows, tensor.device)
    return tensor.movedim((batch_dim, seq_dim), (0, 1))[row_index, position]
