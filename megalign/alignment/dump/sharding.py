"""How a dumped tensor is split over ranks, and how to put the pieces back together.

Every record in a dump says which dim holds the sequence (split over CP ranks in megatron's
load-balanced zigzag: rank r holds chunks r and 2*CP-1-r of 2*CP), whether that sequence is split
again over the TP ranks (`sp`: sequence parallelism, contiguous pieces in tp_rank order), which dim
is partitioned over TP ranks (None: every TP rank holds a replica), how many fused parts that dim
holds (SwiGLU's gate|up: each TP rank holds its slice of every part, so shards are merged part by
part), and which dim holds the batch (split over DP ranks, contiguous; None: DP ranks hold replicas).
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


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2*cp_size) that megatron's get_batch_on_this_cp_rank gives a CP rank."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_positions(local_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global sequence positions held by a CP rank, in its local order."""
    chunk = local_len // 2
    first, second = zigzag_chunks(cp_rank, cp_size)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def merge_cp(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Undo the zigzag: parts[r] is CP rank r's local tensor; returns the natural-order sequence."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = zigzag_chunks(rank, cp_size)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def merge_tp(shards: Sequence[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """Concatenate TP shards on `dim`; with fused parts, concatenate each part's slices first."""
    if len(shards) == 1:
        return shards[0]
    if parts == 1:
        return torch.cat(list(shards), dim=dim)
    sliced = [shard.chunk(parts, dim=dim) for shard in shards]
    return torch.cat([torch.cat([s[p] for s in sliced], dim=dim) for p in range(parts)], dim=dim)
