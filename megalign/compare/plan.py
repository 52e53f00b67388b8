"""Where each shard of a tensor goes in the whole: a plan, plain data worked out from the records and
the layout alone (nothing is read); reassemble.py carries it out.

Every format's shards come here as `Holder`s (a rank's place on each axis, its shape) and the axes
its tensor is split on as `Split`s; `place` works out the plan. megalign dumps (make_plan) name their
axes from the record's sharding and the layout; sglang dumps from their dims (sources/sglang_dims.py),
which may also sum ranks' pieces (`partial`, the plan's terms).

For a megalign dump, each shard's place is worked out per dim by dump/placement.py's rule, as runs of
local positions that land on consecutive global ones. On an axis a tensor is not split on (no tp_dim,
no sequence dim under CP, no dp_dim), the ranks hold replicas: the first is placed, the others are
checked against it, by the content hash the run recorded for each (read only when the hashes differ,
or a dump has none).
Under PP a name lives on one stage, whose ranks are exactly the shards given.
A DTensor's pieces (sharding.mesh) are placed at the offsets they recorded instead, uneven ones too:
ranks of one offset that differ only on Partial mesh dims are summed (`terms`), sums that differ on
other dims are replicas, and the offsets' pieces must tile the whole exactly once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from megalign.dump.format import RankCoords, TensorRecord
from megalign.dump.layout import Layout
from megalign.dump.placement import Run, Split, runs_of, splits_of
from megalign.dump.reader import RankManifest
from megalign.dump.sharding import MeshPlacement


@dataclass
class RankRecord:
    """One rank's record of a tensor, as its manifest holds it."""

    rank: RankManifest
    record: TensorRecord


@dataclass(frozen=True)
class Replica:
    """A rank holding the same values as a placed one: not placed, checked against it. `read`: its
    values are read to be checked (no hash, or a hash other than the placed shard's)."""

    coords: RankCoords
    read: bool
    terms: tuple[RankCoords, ...] = ()  # the ranks whose pieces are added to it (Partial)


@dataclass(frozen=True)
class Piece:
    """One placed shard: the runs of every dim it covers only part of (other dims: whole), in dim order."""

    coords: RankCoords
    runs: tuple[tuple[int, tuple[Run, ...]], ...]
    replicas: tuple[Replica, ...] = ()
    terms: tuple[RankCoords, ...] = ()  # the ranks whose pieces are added to it (a DTensor's Partial)


@dataclass(frozen=True)
class Plan:
    """The whole tensor's shape, the shards' (all alike), the axes it is split on, and every placed shard."""

    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    splits: tuple[Split, ...]
    pieces: tuple[Piece, ...]
    mesh: Optional[MeshPlacement] = None  # a DTensor's: its pieces lie at their own offsets
    summed: tuple[str, ...] = ()  # the axes whose ranks' pieces are added (sglang's `partial`)

    def explain(self) -> list[str]:
        """The plan as lines: the split, then every rank, in rank order: where its piece goes, or
        whose replica it is."""
        splits = _mesh_text(self.mesh) if self.mesh else \
            ", ".join(_split_text(s) for s in self.splits) or "not split: every rank holds all of it"
        if self.summed:
            splits += f"; partial pieces summed over {', '.join(self.summed)}"
        count = len(self.pieces)
        lines = [f"{_shape_text(self.shape)} from {count} piece{'' if count == 1 else 's'} of "
                 f"{_shape_text(self.shard_shape)}; {splits}"]
        ranks: list[tuple[int, str]] = []
        for piece in self.pieces:
            ranks.append((piece.coords.rank, f"{_coords_text(piece.coords)}: {_runs_text(piece.runs)}"))
            ranks += [(c.rank, f"{_coords_text(c)}: added to rank {piece.coords.rank}'s piece (partial sum)")
                      for c in piece.terms]
            ranks += [(r.coords.rank, f"{_coords_text(r.coords)}: replica of rank {piece.coords.rank}, "
                                      + ("read and checked against it" if r.read else "same hash: not read"))
                      for r in piece.replicas]
        return lines + [f"  {text}" for _, text in sorted(ranks)]


class Unassemblable(ValueError):
    """Shards are missing, differ in shape, or do not make up the whole: the tensor cannot be put back together."""


def same_shape(shapes: Iterable[tuple[int, ...]]) -> None:
    """Replicas (and shards) of one tensor have one shape; Unassemblable otherwise."""
    found = set(shapes)
    if len(found) > 1:
        raise Unassemblable(f"has replicas of different shapes {sorted(found)}: not the same tensor on every rank")


def make_plan(shards: list[RankRecord], layout: Layout,
              row_bounds: Callable[[int], Optional[tuple[int, ...]]] = lambda dp_rank: None) -> Plan:
    """Every shard's runs, or its place among the replicas of another; Unassemblable when the shards
    do not make up the whole tensor exactly once. `row_bounds(dp_rank)`: where that DP rank's row was
    cut for the CP split (reader.DumpFiles.cp_bounds), None for a whole row."""
    if any(s.record.sharding.mesh for s in shards):
        return _mesh_plan(shards)
    ordered = sorted(shards, key=lambda s: (s.rank.coords.dp_rank, s.rank.coords.cp_rank, s.rank.coords.tp_rank))
    plan = place([Holder(coords=c, at={"TP": c.tp_rank, "SP": c.tp_rank, "CP": c.cp_rank, "DP": c.dp_rank},
                         shape=tuple(s.record.shape), digest=_digest(s.record), bounds=row_bounds(c.dp_rank))
                  for s in ordered for c in [s.rank.coords]], splits_of(shards[0].record.sharding, layout))
    shape = full_shape(shards, layout)
    if math.prod(plan.shape) != math.prod(shape):  # ranks that claim the same coordinates, counted in the shape
        raise Unassemblable(f"has shards of {_shape_text(plan.shard_shape)} that do not make up its "
                            f"{_shape_text(shape)} (ranks that claim the same place)")
    return plan


@dataclass(frozen=True)
class Holder:
    """One rank's shard as a plan sees it, whatever the format: who holds it, its rank on each axis
    the splits and sums name, its shape, what its bytes are where the run recorded a hash, and where
    its row was cut for a zigzag split (None: a whole row)."""

    coords: RankCoords
    at: dict[str, int]
    shape: tuple[int, ...]
    digest: Optional[tuple[str, str]] = None
    bounds: Optional[tuple[int, ...]] = None


def place(holders: list[Holder], splits: tuple[Split, ...], summed: tuple[tuple[str, int], ...] = ()) -> Plan:
    """The plan of shards split on `splits` (on one dim, innermost first) and summed over the ranks
    of `summed` ((axis, size): partial pieces): holders of one place (the same rank on every split
    axis) make its sum, and the sums beyond the first are its replicas. The first holder of each
    place, in the order given, is placed."""
    same_shape(h.shape for h in holders)
    for split in splits:
        outside = sorted({h.at[split.axis] for h in holders} - set(range(split.size)))
        if outside:
            raise Unassemblable(f"has {split.axis} ranks {outside} outside its {split.size}")
    places: dict[tuple[int, ...], dict[tuple[int, ...], list[Holder]]] = {}
    for holder in holders:
        key = tuple(holder.at[s.axis] for s in splits)
        places.setdefault(key, {}).setdefault(tuple(holder.at[axis] for axis, _ in summed), []).append(holder)
    expected = math.prod(s.size for s in splits)
    if len(places) != expected:
        axes = " x ".join(f"{s.size} {'TP' if s.axis == 'SP' else s.axis}" for s in splits)
        raise Unassemblable(f"has {len(places)} of the {expected} shards its split ({axes}) makes")
    terms = math.prod(size for _, size in summed)
    pieces = []
    for by_term in places.values():
        copies = {len(group) for group in by_term.values()}
        if len(by_term) != terms or len(copies) != 1:
            raise Unassemblable(f"has {len(by_term)} of the {terms} partial pieces summed, or as many copies of each")
        # The i-th holder of every term makes the i-th sum: the first is placed, the others are its replicas.
        sums = [[by_term[t][i] for t in sorted(by_term)] for i in range(copies.pop())]
        first = sums[0]
        pieces.append(Piece(coords=first[0].coords, runs=runs_of(first[0].shape, first[0].at, first[0].bounds, splits), terms=tuple(h.coords for h in first[1:]),
                            replicas=tuple(Replica(copy[0].coords, read=not all(_same_digest(a.digest, b.digest) for a, b in zip(first, copy)),
                                                   terms=tuple(h.coords for h in copy[1:])) for copy in sums[1:])))
    shape = list(holders[0].shape)
    for split in splits:
        shape[split.dim] *= split.size
    return Plan(shape=tuple(shape), shard_shape=holders[0].shape, splits=splits, pieces=tuple(pieces),
                summed=tuple(axis for axis, _ in summed))


def _mesh_plan(shards: list[RankRecord]) -> Plan:
    """A DTensor's plan: each offset's piece placed once (its Partial terms summed into it), the
    other sums of that offset its replicas; an empty piece (an uneven split's last) holds nothing."""
    mesh = shards[0].record.sharding.mesh
    for shard in shards:
        other = shard.record.sharding.mesh
        if other is None or (other.shape, other.placements, other.whole) != (mesh.shape, mesh.placements, mesh.whole):
            raise Unassemblable("has pieces on different device meshes, placements or whole shapes")
    if len({s.record.sharding.mesh.coord for s in shards}) != len(shards):
        raise Unassemblable("has pieces from ranks that claim the same mesh coordinate")
    terms = math.prod(mesh.shape[d] for d in mesh.summed)
    sums: dict[tuple, dict[tuple, list[RankRecord]]] = {}  # offset -> coordinate off the summed dims -> its terms
    for shard in sorted(shards, key=lambda s: s.rank.coords.rank):
        piece = shard.record.sharding.mesh
        if math.prod(shard.record.shape):
            kept = tuple(c for d, c in enumerate(piece.coord) if d not in mesh.summed)
            sums.setdefault(piece.offset, {}).setdefault(kept, []).append(shard)
    pieces, boxes = [], []
    for offset, groups in sums.items():
        placed, *copies = groups.values()
        same_shape(tuple(s.record.shape) for group in groups.values() for s in group)
        if any(len(group) != terms for group in groups.values()):
            raise Unassemblable(f"has {min(map(len, groups.values()))} of the {terms} partial pieces summed at "
                                f"offset {list(offset)}")
        shape = placed[0].record.shape
        boxes.append((offset, shape))
        runs = tuple((d, (Run(0, start, size),)) for d, (start, size) in enumerate(zip(offset, shape))
                     if size != mesh.whole[d])
        pieces.append(Piece(coords=placed[0].rank.coords, runs=runs, terms=tuple(s.rank.coords for s in placed[1:]),
                            replicas=tuple(Replica(copy[0].rank.coords, read=not _same_bytes(placed, copy),
                                                   terms=tuple(s.rank.coords for s in copy[1:])) for copy in copies)))
    _check_tiling(boxes, mesh.whole)
    return Plan(shape=mesh.whole, shard_shape=tuple(shards[0].record.shape), splits=(), pieces=tuple(pieces),
                mesh=mesh)


def _check_tiling(boxes: list[tuple[tuple[int, ...], list[int]]], whole: tuple[int, ...]) -> None:
    """The pieces (offset, shape) cover the whole exactly once: no two overlap, and together they are as big."""
    if sum(math.prod(shape) for _, shape in boxes) != math.prod(whole):
        raise Unassemblable(f"has pieces that do not make up its {_shape_text(whole)}")
    for (a, a_shape), (b, b_shape) in itertools.combinations(boxes, 2):
        if all(x < y + m and y < x + n for x, n, y, m in zip(a, a_shape, b, b_shape)):
            raise Unassemblable(f"has pieces at offsets {list(a)} and {list(b)} that overlap")


def _digest(record: TensorRecord) -> Optional[tuple[str, str]]:
    """The bytes the run recorded for a record (dump.format's hash, with its dtype), None without one."""
    return None if record.hash is None else (record.hash, record.dtype)


def _same_digest(a: Optional[tuple[str, str]], b: Optional[tuple[str, str]]) -> bool:
    """The run recorded the same bytes for both: the replica need not be read."""
    return a is not None and a == b


def _same_bytes(placed: list[RankRecord], copy: list[RankRecord]) -> bool:
    return all(_same_digest(_digest(a.record), _digest(b.record)) for a, b in zip(placed, copy))


def full_shape(shards: list[RankRecord], layout: Layout) -> list[int]:
    """The reassembled shape, from the records alone (also for stats-only dumps)."""
    record = shards[0].record
    if record.sharding.mesh is not None:
        return list(record.sharding.mesh.whole)
    shape = list(record.shape)
    sharding = record.sharding
    first = shards[0].rank.coords
    if sharding.tp_dim is not None or sharding.sp:
        tp_shards = sum(1 for s in shards if (s.rank.coords.cp_rank, s.rank.coords.dp_rank) ==
                        (first.cp_rank, first.dp_rank))
        shape[sharding.seq_dim if sharding.sp else sharding.tp_dim] *= tp_shards
    if sharding.seq_dim is not None and layout.cp > 1:
        shape[sharding.seq_dim] *= layout.cp
    if sharding.dp_dim is not None:
        shape[sharding.dp_dim] *= layout.dp
    return shape


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def _split_text(split: Split) -> str:
    how = (f" ({split.parts} parts, each split)" if split.parts > 1 else "") + (" (zigzag)" if split.zigzag else "")
    return f"{split.axis} {split.size} along dim {split.dim}{how}"


def _mesh_text(mesh: MeshPlacement) -> str:
    """`DTensor on mesh 2 (S0): pieces at their offsets`; with partial sums said."""
    summed = "; partial pieces summed" if mesh.summed else ""
    return f"DTensor on mesh {_shape_text(mesh.shape)} ({', '.join(mesh.placements)}): pieces at their offsets{summed}"


def _coords_text(c: RankCoords) -> str:
    return f"rank {c.rank} (tp {c.tp_rank} cp {c.cp_rank} dp {c.dp_rank} pp {c.pp_rank})"


def _runs_text(runs: tuple[tuple[int, tuple[Run, ...]], ...]) -> str:
    """`dim 0 [0:4] -> [0:4], [4:8] -> [12:16]`: local ranges and where they go along each split dim."""
    if not runs:
        return "all of it, as it is"
    return "; ".join(f"dim {dim} " + ", ".join(f"[{r.local}:{r.local + r.length}] -> [{r.start}:{r.start + r.length}]"
                                               for r in dim_runs) for dim, dim_runs in runs)
