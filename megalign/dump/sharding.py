"""How a dumped tensor is split over ranks, and how to put the pieces back together.

Every record in a dump says which dim holds the sequence (split over CP ranks in megatron's
load-balanced zigzag: rank r holds chunks r and 2*CP-1-r of 2*CP), whether that sequence is split
again over the TP ranks (`sp`: sequence parallelism, contiguous pieces in tp_rank order), which dim
is partitioned over TP ranks (None: every TP rank holds a replica), how many fused parts that dim
holds (SwiGLU's gate|up: each TP rank holds its slice of every part, so shards are merged part by
part), and which dim holds the batch (split over DP ranks, contiguous; None: DP ranks hold replicas).
A packed row is zigzagged document by document; its documents' bounds are the dump's `rows`.
Where each piece lies (the zigzag, the rows) is layout.py's; this module puts pieces together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megalign.dump.layout import cp_bounds, cp_positions, zigzag_positions  # noqa: F401 (zigzag_positions: re-exported)


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


def merge_cp(parts: Sequence[torch.Tensor], dim: int, bounds: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Undo the zigzag: parts[r] is CP rank r's local tensor; returns the row in natural order.
    `bounds`: the documents each zigzagged on its own (a packed row); None: the whole row is one."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    joined = torch.cat(list(parts), dim=dim)
    bounds = cp_bounds(bounds, parts[0].shape[dim], cp_size)
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
