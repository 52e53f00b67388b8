"""Put one tensor of a megalign dump back together from the shards of all ranks that hold it.

Each shard's place in the full tensor is worked out per dim, as runs of local positions that land
on consecutive global ones: along tp_dim, TP shards in tp_rank order (fused tensors, tp_parts,
part by part); along the sequence dim, SP pieces in tp_rank order within their CP rank's piece, then
the CP zigzag undone (document by document in a packed row, at the dump's bounds); along dp_dim, DP
ranks in order. On an axis a tensor is not split on (no tp_dim, no sequence dim under CP, no
dp_dim), the ranks hold replicas: the first is placed, the others are checked against it, by the
content hash the run recorded for each (read only when the hashes differ, or a dump has none, and
then measured as a ReplicaGap).
Under PP a name lives on one stage, whose ranks are exactly the shards given.

The full tensor is allocated once (in the caller's buffer when given: verdict.py reuses them) and
every shard is read from its file straight into its place, one positioned read per block, where the
block is contiguous on both sides; otherwise the shard is read whole and copied block by block.
Stats-only records are combined with TensorStats.combine over the placed shards.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from megalign.compare.entries import ReplicaGap, Value
from megalign.compare.fused import Sums
from megalign.compare.metrics import pair_sums
from megalign.dump.format import TensorRecord
from megalign.dump.reader import Dump, RankManifest
from megalign.dump.layout import cp_bounds, cp_positions
from megalign.dump.stats import TensorStats
from megalign.dump.tensorfile import read_into

Run = tuple[int, int, int]  # (local start, global start, length) along one dim


@dataclass
class Shard:
    rank: RankManifest
    record: TensorRecord


@dataclass
class _Placed:
    shard: Shard
    runs: dict[int, list[Run]] = field(default_factory=dict)  # dims the shard covers only part of
    replicas: list[Shard] = field(default_factory=list)  # shards holding the same values


class _Missing(ValueError):
    """Shards are missing, or differ in shape: the tensor cannot be put back together."""


def reassemble(dump: Dump, shards: list[Shard], buffer: Optional[torch.Tensor] = None,
               rows: Optional[tuple[int, int]] = None) -> Value:
    """The tensor (or, for --stats-only records, its statistics). `buffer` (bytes, at least the
    tensor's size): the tensor lives in it. `rows` (start, stop): only those positions of dim 0 are
    read, into a tensor of that many rows (verdict.py streams big tensors so); `shape` stays the whole's."""
    layout = dump.layout()
    first = shards[0].record
    value = Value(shape=full_shape(shards, layout), dtype=first.dtype)
    try:
        placed = _place(dump, shards, layout)
    except _Missing as e:
        value.problem = str(e)
        return value
    if first.file is None:
        value.stats = TensorStats.combine(p.shard.record.stats for p in placed)
        return value
    dtype = dump.locate(shards[0].rank, first).dtype
    shape = value.shape if rows is None else [rows[1] - rows[0], *value.shape[1:]]
    full = _allocate(shape, dtype, buffer)
    for p in placed:
        _read_placed(dump, p.shard, p, full, rows)
    value.replicas = [_replica_gap(dump, p, replica, full, rows) for p in placed for replica in p.replicas
                      if not _same_content(p.shard, replica)]
    value.tensor = full
    return value


def _place(dump: Dump, shards: list[Shard], layout: dict) -> list[_Placed]:
    """Every shard's runs, or its place among the replicas of another; _Missing when the shards do
    not make up the whole tensor exactly once."""
    sharding = shards[0].record.sharding
    tp, cp, dp = layout["tp"], layout["cp"], layout.get("dp", 1)
    split_tp = sharding.sp or sharding.tp_dim is not None
    split_cp = sharding.seq_dim is not None and cp > 1
    split_dp = sharding.dp_dim is not None and dp > 1
    shapes = {tuple(s.record.shape) for s in shards}
    if len(shapes) > 1:
        raise _Missing(f"has replicas of different shapes {sorted(shapes)}: not the same tensor on every rank")
    by_key: dict[tuple[int, int, int], _Placed] = {}
    for shard in sorted(shards, key=lambda s: (s.rank.coords.dp_rank, s.rank.coords.cp_rank, s.rank.coords.tp_rank)):
        c = shard.rank.coords
        key = (c.tp_rank if split_tp else 0, c.cp_rank if split_cp else 0, c.dp_rank if split_dp else 0)
        if key in by_key:
            by_key[key].replicas.append(shard)
        else:
            by_key[key] = _Placed(shard, _runs(shard, layout, dump.cp_bounds(c.dp_rank), split_tp, split_cp, split_dp))
    expected = (tp if split_tp else 1) * (cp if split_cp else 1) * (dp if split_dp else 1)
    if len(by_key) != expected:
        axes = [f"{n} {name}" for n, name, split in ((tp, "TP", split_tp), (cp, "CP", split_cp), (dp, "DP", split_dp))
                if split]
        raise _Missing(f"has {len(by_key)} of the {expected} shards its split ({' x '.join(axes)}) makes")
    return list(by_key.values())


def _runs(shard: Shard, layout: dict, bounds, split_tp: bool, split_cp: bool, split_dp: bool) -> dict[int, list[Run]]:
    shape, sharding, c = shard.record.shape, shard.record.sharding, shard.rank.coords
    runs: dict[int, list[Run]] = {}
    if split_tp and sharding.sp:
        size = shape[sharding.seq_dim]
        runs[sharding.seq_dim] = [(0, c.tp_rank * size, size)]  # within this CP rank's piece
    elif split_tp:
        parts = sharding.tp_parts
        size = shape[sharding.tp_dim] // parts
        runs[sharding.tp_dim] = [(p * size, (p * layout["tp"] + c.tp_rank) * size, size) for p in range(parts)]
    if split_cp:
        dim = sharding.seq_dim
        piece = shape[dim] * (layout["tp"] if sharding.sp else 1)
        positions = cp_positions(cp_bounds(bounds, piece, layout["cp"]), c.cp_rank, layout["cp"]).tolist()
        runs[dim] = _through(runs.get(dim, [(0, 0, shape[dim])]), positions)
    if split_dp:
        size = shape[sharding.dp_dim]
        runs[sharding.dp_dim] = [(0, c.dp_rank * size, size)]
    return runs


def _through(runs: list[Run], positions: list[int]) -> list[Run]:
    """Runs whose global starts index `positions`, mapped onto those positions (split where they jump)."""
    mapped = []
    for local, start, length in runs:
        begin = 0
        for i in range(1, length + 1):
            if i == length or positions[start + i] != positions[start + i - 1] + 1:
                mapped.append((local + begin, positions[start + begin], i - begin))
                begin = i
    return mapped


def _allocate(shape: list[int], dtype: torch.dtype, buffer: Optional[torch.Tensor]) -> torch.Tensor:
    if buffer is None:
        return torch.empty(shape, dtype=dtype)
    size = math.prod(shape) * dtype.itemsize
    return buffer[:size].view(dtype).view(shape)


def _blocks(placed: _Placed, rows: Optional[tuple[int, int]]):
    """(local narrowings, narrowings of the output) of every block of a shard: one run per split dim;
    with `rows`, dim 0 clipped to them (the output then starts at rows[0])."""
    runs = dict(placed.runs)
    if rows is not None:
        start, stop = rows
        clipped = []
        for local, where, length in runs.get(0, [(0, 0, placed.shard.record.shape[0])]):
            low, high = max(where, start), min(where + length, stop)
            if low < high:
                clipped.append((local + low - where, low - start, high - low))
        runs[0] = clipped
    dims = sorted(runs)
    for combo in itertools.product(*(runs[d] for d in dims)):
        yield [(d, r[0], r[2]) for d, r in zip(dims, combo)], [(d, r[1], r[2]) for d, r in zip(dims, combo)]


def _narrow(tensor: torch.Tensor, narrowings) -> torch.Tensor:
    for dim, start, length in narrowings:
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _read_placed(dump: Dump, shard: Shard, placed: _Placed, out: torch.Tensor, rows) -> None:
    """Read `shard` into out at `placed`'s blocks. A block contiguous in the shard and in `out` is one
    positioned read straight into place; any other is read with the whole rows of the shard it
    spans (contiguous in the file) into a temporary, and copied."""
    location = dump.locate(shard.rank, shard.record)
    blocks = list(_blocks(placed, rows))
    if blocks == [([], [])]:  # the whole tensor
        read_into(location, out)
        return
    layout = torch.empty(location.shape, dtype=location.dtype, device="meta")  # strides and offsets only
    spans: dict[tuple[int, int], torch.Tensor] = {}
    for local, where in blocks:
        src, dst = _narrow(layout, local), _narrow(out, where)
        if src.is_contiguous() and dst.is_contiguous():
            read_into(location, dst, src.storage_offset() * src.element_size())
            continue
        first, count = next(((start, n) for dim, start, n in local if dim == 0), (0, location.shape[0]))
        span = spans.get((first, count))
        if span is None:
            span = spans[(first, count)] = torch.empty((count, *location.shape[1:]), dtype=location.dtype)
            read_into(location, span, layout[first].storage_offset() * layout.element_size() if count else 0)
        dst.copy_(_narrow(span, [(d, start - first if d == 0 else start, n) for d, start, n in local]))


def _same_content(shard: Shard, replica: Shard) -> bool:
    """The run recorded the same bytes for both (dump.format's hash): the replica need not be read."""
    a, b = shard.record, replica.record
    return a.hash is not None and a.hash == b.hash and a.dtype == b.dtype


def _replica_gap(dump: Dump, placed: _Placed, replica: Shard, out: torch.Tensor, rows) -> ReplicaGap:
    """How far a replica is from the values placed for the shard it copies: read into the same place
    of a scratch tensor and compared block by block."""
    scratch = torch.empty_like(out)
    _read_placed(dump, replica, placed, scratch, rows)
    total = Sums()
    for _, where in _blocks(placed, rows):
        total.add(pair_sums(_narrow(scratch, where), _narrow(out, where)), 0)
    return ReplicaGap(ranks=f"rank {replica.rank.coords.rank} vs rank {placed.shard.rank.coords.rank}", sums=total)


def first_replica(replicas: list[tuple[int, torch.Tensor]], gaps: list[ReplicaGap]) -> torch.Tensor:
    """The first of (rank, tensor) replicas, after recording how far the others are from it (sglang.py)."""
    shapes = {tuple(getattr(r, "shape", ())) for _, r in replicas}
    if len(shapes) > 1:
        raise _Missing(f"has replicas of different shapes {sorted(shapes)}: not the same tensor on every rank")
    rank, first = replicas[0]
    gaps.extend(ReplicaGap(ranks=f"rank {other_rank} vs rank {rank}", sums=pair_sums(other, first))
                for other_rank, other in replicas[1:] if not torch.equal(other, first))
    return first


def full_shape(shards: list[Shard], layout: dict) -> list[int]:
    """The reassembled shape, from the records alone (also for stats-only dumps)."""
    record = shards[0].record
    shape = list(record.shape)
    sharding = record.sharding
    first = shards[0].rank.coords
    if sharding.tp_dim is not None or sharding.sp:
        tp_shards = sum(1 for s in shards if (s.rank.coords.cp_rank, s.rank.coords.dp_rank) ==
                        (first.cp_rank, first.dp_rank))
        shape[sharding.seq_dim if sharding.sp else sharding.tp_dim] *= tp_shards
    if sharding.seq_dim is not None and layout["cp"] > 1:
        shape[sharding.seq_dim] *= layout["cp"]
    if sharding.dp_dim is not None:
        shape[sharding.dp_dim] *= layout.get("dp", 1)
    return shape
