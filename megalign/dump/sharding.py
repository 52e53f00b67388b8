"""How a dumped tensor is split over ranks, and how to put the pieces back together.

Every record in a dump says which dim holds the sequence (split over CP ranks in megatron's
load-balanced zigzag: rank r holds chunks r and 2*CP-1-r of 2*CP), whether that sequence is split
again over the TP ranks (`sp`: sequence parallelism, contiguous pieces in tp_rank order), which dim
is partitioned over TP ranks (None: every TP rank holds a replica), how many fused parts that dim
holds (SwiGLU's gate|up: each TP rank holds its slice of every part, so shards are merged part by
part), and which dim holds the batch (split over DP ranks, contiguous; None: DP ranks hold replicas).
A packed row is zigzagged document by document; its documents' bounds are the dump's `rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class Sharding:
    seq_dim: Optional[int] = None
    tp_dim: Optional[int] = None
    tp_parts: int = 1
    sp: bool = False
    dp_dim: Optional[int] = None

    def to_dict(self) -> dict:
        return {"seq_dim": self.seq_dim, "tp_dim": self.tp_dim, "tp_parts": self.tp_parts, "sp": self.sp,
                "dp_dim": self.dp_dim}


REPLICATED = Sharding()


@dataclass(frozen=True)
class BatchRow:
    """One row of the batch as the model saw it: where its documents start and end once padded
    (`bounds`, from 0 to the row's length) and how many real tokens each holds (`lengths`). A padded
    batch has one document a row; a packed (THD) row holds several, back to back."""

    bounds: tuple[int, ...]
    lengths: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "lengths": list(self.lengths)}


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
    return cp_positions((0, local_len * cp_size), cp_rank, cp_size, device=device)


def merge_cp(parts: Sequence[torch.Tensor], dim: int, bounds: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Undo the zigzag: parts[r] is CP rank r's local tensor; returns the row in natural order.
    `bounds`: the documents each zigzagged on its own (a packed row); None: the whole row is one."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    joined = torch.cat(list(parts), dim=dim)
    bounds = bounds or (0, joined.shape[dim])
    where = torch.cat([cp_positions(bounds, rank, cp_size) for rank in range(cp_size)])
    return torch.empty_like(joined).index_copy_(dim, where.to(joined.device), joined)


def merge_tp(shards: Sequence[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """Concatenate TP shards on `dim`; with fused parts, concatenate each part's slices first."""
    if len(shards) == 1:
        return shards[0]
    if parts == 1:
        return torch.cat(list(shards), dim=dim)
    sliced = [shard.chunk(parts, dim=dim) for shard in shards]
    return torch.cat([torch.cat([s[p] for s in sliced], dim=dim) for p in range(parts)], dim=dim)
