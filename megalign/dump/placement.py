"""Where a rank's shard of a tensor lies in the whole, along each dim it is split on: the rule that
compare's plans (compare/plan.py) put shards back by, and that each rank's sketch (sketch.py) is taken
in the whole's coordinates by, stated once.

Along tp_dim, TP shards lie in tp_rank order (fused tensors, tp_parts, part by part); along the
sequence dim, SP pieces in tp_rank order within their CP rank's piece, then CP's zigzag (document by
document in a packed row, at the row's bounds); along dp_dim, DP ranks in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from megalign.dump.format import RankCoords
from megalign.dump.layout import Layout, cp_bounds, cp_positions
from megalign.dump.sharding import Sharding


class Run(NamedTuple):
    """Along one dim: the shard's `length` positions from `local` land on the whole's from `start`."""

    local: int
    start: int
    length: int


@dataclass(frozen=True)
class Split:
    """One axis the tensor is split on: its size, the dim it splits, and how (`parts`: fused tensors'
    parts, each split on its own; `zigzag`: CP's load-balanced order)."""

    axis: str  # TP, SP (TP ranks along the sequence), CP or DP
    size: int
    dim: int
    parts: int = 1
    zigzag: bool = False


def splits_of(sharding: Sharding, layout: Layout) -> tuple[Split, ...]:
    """The axes of more than one rank a tensor of `sharding` is split on, in the order its runs are worked out."""
    splits = []
    if sharding.sp and layout.tp > 1:
        splits.append(Split("SP", layout.tp, sharding.seq_dim))
    elif sharding.tp_dim is not None and layout.tp > 1:
        splits.append(Split("TP", layout.tp, sharding.tp_dim, parts=sharding.tp_parts))
    if sharding.seq_dim is not None and layout.cp > 1:
        splits.append(Split("CP", layout.cp, sharding.seq_dim, zigzag=True))
    if sharding.dp_dim is not None and layout.dp > 1:
        splits.append(Split("DP", layout.dp, sharding.dp_dim))
    return tuple(splits)


def runs_of(shape: tuple[int, ...], at: dict[str, int], bounds: Optional[tuple[int, ...]],
            splits: tuple[Split, ...]) -> tuple[tuple[int, tuple[Run, ...]], ...]:
    """Where the positions of a shard of `shape` go along each split dim, for the rank `at` (its rank
    on each axis) whose row was cut at `bounds` for a zigzag split (None: a whole row): its own runs
    carried outward split by split, from the innermost piece (the shard) to the whole."""
    runs: dict[int, list[Run]] = {}
    pieces: dict[int, int] = {}  # the size of the piece reached so far along each dim
    for split in splits:
        inner = pieces.get(split.dim, shape[split.dim])
        local = runs.get(split.dim, [Run(0, 0, inner)])
        rank = at[split.axis]
        if split.zigzag:
            runs[split.dim] = _through(local, cp_positions(cp_bounds(bounds, inner, split.size), rank,
                                                           split.size).tolist())
        else:
            runs[split.dim] = _outward(local, inner // split.parts, split.size, rank)
        pieces[split.dim] = inner * split.size
    return tuple((dim, tuple(runs[dim])) for dim in sorted(runs))


def _outward(runs: list[Run], part: int, size: int, rank: int) -> list[Run]:
    """Runs within a rank's piece carried into the whole of `size` such pieces laid side by side part
    by part (one part: the rank's piece is the rank-th; fused tensors: each of its parts is)."""
    moved = []
    for local, start, length in runs:
        while length:
            index, offset = divmod(start, part)
            n = min(length, part - offset)
            moved.append(Run(local, (index * size + rank) * part + offset, n))
            local, start, length = local + n, start + n, length - n
    return moved


def _through(runs: list[Run], positions: list[int]) -> list[Run]:
    """Runs whose global starts index `positions`, mapped onto those positions (split where they jump)."""
    mapped = []
    for local, start, length in runs:
        begin = 0
        for i in range(1, length + 1):
            if i == length or positions[start + i] != positions[start + i - 1] + 1:
                mapped.append(Run(local + begin, positions[start + begin], i - begin))
                begin = i
    return mapped


def positions(shape: tuple[int, ...], sharding: Sharding, coords: RankCoords, layout: Layout,
              bounds: Optional[tuple[int, ...]] = None) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """The whole tensor's shape, and for each dim of a rank's shard of `shape` the whole's position of
    each of its positions along it. A DTensor's piece lies at its recorded offset; a partial piece
    (offset 0) over the whole."""
    if sharding.mesh is not None:
        return tuple(sharding.mesh.whole), [torch.arange(o, o + n) for o, n in zip(sharding.mesh.offset, shape)]
    splits = splits_of(sharding, layout)
    at = {"TP": coords.tp_rank, "SP": coords.tp_rank, "CP": coords.cp_rank, "DP": coords.dp_rank}
    where = [torch.arange(n) for n in shape]
    whole = list(shape)
    for dim, runs in runs_of(tuple(shape), at, bounds, splits):
        for local, start, length in runs:
            where[dim][local:local + length] = torch.arange(start, start + length)
    for split in splits:
        whole[split.dim] *= split.size
    return tuple(whole), where
