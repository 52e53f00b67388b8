"""How a dumped tensor is split over ranks, and how to put the pieces back together.

Every record in a dump says which dim holds the sequence (split over CP ranks in megatron's
load-balanced zigzag: rank r holds chunks r and 2*CP-1-r of 2*CP), whether that sequence is split
again over the TP ranks (`sp`: sequence parallelism, contiguous pieces in tp_rank order), which dim
is partitioned over TP ranks (None: every TP rank holds a replica), how many fused parts that dim
holds (SwiGLU's gate|up: each TP rank holds its slice of every part, so shards are merged part by
part), and which dim holds the batch (split over DP ranks, contiguous; None: DP ranks hold replicas).
A packed row is zigzagged document by document; its documents' bounds are the dump's `rows`.
A DTensor's piece (torch's FSDP2, tensor parallel) says where it lies itself (`mesh`: MeshPlacement),
from the DTensor's placements: uneven shards and any device mesh, in place of the axes above.
Where each piece lies (the zigzag, the rows) is layout.py's; this module puts pieces together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megalign.dump.layout import cp_bounds, cp_positions, zigzag_positions  # noqa: F401 (zigzag_positions: re-exported)


@dataclass(frozen=True)
class MeshPlacement:
    """Where a DTensor's local piece lies, as torch computed it: the device mesh's `shape`, this
    rank's `coord` on it, each mesh dim's placement (`S<d>`: split along tensor dim d, `R`: replicas,
    `P`: partial values that sum to the whole), the whole tensor's shape and the piece's offset in it.
    Ranks whose pieces share an offset and differ only on `P` dims are summed; such sums that differ
    only on `R` dims are replicas. Offsets are recorded, not recomputed: uneven last shards (3 rows
    over 2 ranks: 2 + 1), empty ones, and strided shards (FSDP2 over TP) need no rule of their own."""

    shape: tuple[int, ...]
    coord: tuple[int, ...]
    placements: tuple[str, ...]
    whole: tuple[int, ...]
    offset: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "coord": list(self.coord), "placements": list(self.placements),
                "global_shape": list(self.whole), "offset": list(self.offset)}

    @property
    def summed(self) -> tuple[int, ...]:
        """The mesh dims whose ranks hold partial values, summed by compare."""
        return tuple(i for i, p in enumerate(self.placements) if p == "P")


@dataclass(frozen=True)
class Sharding:
    seq_dim: Optional[int] = None
    tp_dim: Optional[int] = None
    tp_parts: int = 1
    sp: bool = False
    dp_dim: Optional[int] = None
    mesh: Optional[MeshPlacement] = None  # a DTensor's piece: the other fields are then unset
    # "sum" or "mean": every rank holds a partial value of the tensor (a per-rank loss, the gradient of
    # an output every row shares), the whole being their sum or mean over the ranks that hold other
    # data. Given to add(); the Dumper records it as a mesh piece (dump/partial.py), never as itself.
    partial: Optional[str] = None

    def to_dict(self) -> dict:
        axes = {"seq_dim": self.seq_dim, "tp_dim": self.tp_dim, "tp_parts": self.tp_parts, "sp": self.sp,
                "dp_dim": self.dp_dim}
        return axes if self.mesh is None else {**axes, "mesh": self.mesh.to_dict()}


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
