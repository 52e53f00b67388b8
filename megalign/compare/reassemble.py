"""Carry out a plan (plan.py): put one tensor back together from the shards of all ranks that hold it.
A format gives `execute` a Read: megalign dumps read each shard from its file in place (reassemble),
sglang dumps copy from the tensors their files hold (in_memory).

The full tensor is allocated once (in the caller's buffer when given: execution.py reuses them) and
every placed shard is read from its file straight into its place, one positioned read per block,
where the block is contiguous on both sides; otherwise the shard is read whole and copied block by
block. Partial pieces (the plan's terms: a DTensor's, sglang's `partial`) are read into a scratch tensor and added in
place, in rank order. A replica the plan says to read is read (and summed) into the same place of a
scratch tensor and measured against the placed values as a ReplicaGap. Stats-only records are
combined with TensorStats.combine over the placed shards; partial sums cannot be, and say so. Their
sketches, each taken at its shard's positions in the whole, are summed over the placed shards and
their partial terms (replicas once): a partial sum keeps its sketch alone.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Optional

import torch

from megalign.compare.entries import ReplicaGap, Value, Window
from megalign.compare.fused import Sums
from megalign.compare.metrics import pair_sums
from megalign.compare.plan import Piece, Plan, RankRecord, Unassemblable, full_shape, make_plan
from megalign.dump.format import RankCoords
from megalign.dump.reader import DumpFiles
from megalign.dump.sketch import combine
from megalign.dump.stats import TensorStats
from megalign.dump.tensorfile import read_into


def plan_of(dump: DumpFiles, shards: list[RankRecord]) -> Plan:
    """The plan of a tensor of `dump` held by `shards`; Unassemblable when there is none."""
    return make_plan(shards, dump.layout, dump.cp_bounds)


def reassemble(dump: DumpFiles, shards: list[RankRecord], buffer: Optional[torch.Tensor] = None,
               window: Optional[Window] = None) -> Value:
    """The tensor (or, for --stats-only records, its statistics). `buffer` (bytes, at least the
    tensor's size): the tensor lives in it. `window` ((start, stop) of each leading dim): only that
    box is read, into a tensor of its size (execution.py streams big tensors so); `shape` stays the whole's."""
    first = shards[0].record
    value = Value(shape=full_shape(shards, dump.layout), dtype=first.dtype)
    try:
        plan = plan_of(dump, shards)
    except Unassemblable as e:
        value.problem = str(e)
        return value
    by_rank = {s.rank.coords.rank: s for s in shards}
    if first.file is None:
        held = [by_rank[c.rank].record for p in plan.pieces for c in (p.coords, *p.terms)]
        if all(r.sketch is not None for r in held):  # each at its own positions in the whole: a sum
            value.sketch = combine(r.sketch for r in held)
        if any(p.terms for p in plan.pieces):
            if value.sketch is None:
                value.problem = "is a partial sum over ranks: statistics of its pieces do not make the sum's"
            return value
        value.stats = TensorStats.combine(by_rank[p.coords.rank].record.stats for p in plan.pieces)
        return value

    def read(coords: RankCoords, piece: Piece, out: torch.Tensor, window: Optional[Window]) -> None:
        _read_piece(dump, by_rank[coords.rank], piece, out, window)

    return execute(plan, read, value, dump.locate(shards[0].rank, first).dtype, buffer, window)


# Puts one rank's shard's blocks of a piece in their places in `out` (a window of the whole, where given).
Read = Callable[[RankCoords, Piece, torch.Tensor, Optional[Window]], None]


def execute(plan: Plan, read: Read, value: Value, dtype: torch.dtype, buffer: Optional[torch.Tensor] = None,
            window: Optional[Window] = None) -> Value:
    """Carry out `plan` into `value` (whose shape is the whole's): every piece read (and its partial
    terms added) in place, every replica the plan says to read measured against it."""
    shape = value.shape if window is None else [stop - start for start, stop in window] + value.shape[len(window):]
    full = _allocate(shape, dtype, buffer)
    for piece in plan.pieces:
        _read_sum(read, plan, (piece.coords, *piece.terms), piece, full, window)
    value.replicas = [_replica_gap(read, plan, piece, (replica.coords, *replica.terms), full, window)
                      for piece in plan.pieces for replica in piece.replicas if replica.read]
    value.tensor = full
    return value


def in_memory(load: Callable[[RankCoords], torch.Tensor]) -> Read:
    """The Read of shards a format holds whole in memory (sglang's .pt files): `load` gives a rank's,
    whose blocks are copied into place."""

    def read(coords: RankCoords, piece: Piece, out: torch.Tensor, window: Optional[Window]) -> None:
        tensor = load(coords)
        for local, where in _blocks(piece, list(tensor.shape), window):
            _narrow(out, where).copy_(_narrow(tensor, local))

    return read


def _allocate(shape: list[int], dtype: torch.dtype, buffer: Optional[torch.Tensor]) -> torch.Tensor:
    if buffer is None:
        return torch.empty(shape, dtype=dtype)
    size = math.prod(shape) * dtype.itemsize
    return buffer[:size].view(dtype).view(shape)


def _blocks(piece: Piece, shape: list[int], window: Optional[Window]):
    """(local narrowings, narrowings of the output) of every block of a piece (of a shard of `shape`):
    one run per split dim; with `window`, its leading dims clipped to it (the output then starts at
    the window's corner)."""
    runs = dict(piece.runs)
    for dim, (start, stop) in enumerate(window or ()):
        clipped = []
        for local, where, length in runs.get(dim, [(0, 0, shape[dim])]):
            low, high = max(where, start), min(where + length, stop)
            if low < high:
                clipped.append((local + low - where, low - start, high - low))
        runs[dim] = clipped
    dims = sorted(runs)
    for combo in itertools.product(*(runs[d] for d in dims)):
        yield [(d, r[0], r[2]) for d, r in zip(dims, combo)], [(d, r[1], r[2]) for d, r in zip(dims, combo)]


def _narrow(tensor: torch.Tensor, narrowings) -> torch.Tensor:
    for dim, start, length in narrowings:
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _read_piece(dump: DumpFiles, shard: RankRecord, piece: Piece, out: torch.Tensor, window: Optional[Window]) -> None:
    """Read `shard` into out at `piece`'s blocks. A block contiguous in the shard and in `out` is one
    positioned read straight into place; any other is read with the whole rows of the shard it
    spans (contiguous in the file) into a temporary, and copied."""
    location = dump.locate(shard.rank, shard.record)
    blocks = list(_blocks(piece, shard.record.shape, window))
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


def _read_sum(read: Read, plan: Plan, ranks: tuple[RankCoords, ...], piece: Piece, out: torch.Tensor,
              window: Optional[Window]) -> None:
    """Read the first rank's shard into `out` at `piece`'s blocks, and add the others' (partial terms) there."""
    read(ranks[0], piece, out, window)
    if len(ranks) == 1:
        return
    scratch = torch.empty_like(out)
    for coords in ranks[1:]:
        read(coords, piece, scratch, window)
        for _, where in _blocks(piece, list(plan.shard_shape), window):
            _narrow(out, where).add_(_narrow(scratch, where))


def _replica_gap(read: Read, plan: Plan, piece: Piece, replica: tuple[RankCoords, ...], out: torch.Tensor,
                 window: Optional[Window]) -> ReplicaGap:
    """How far a replica (with its partial terms) is from the values placed for the piece it copies:
    read into the same place of a scratch tensor and compared block by block."""
    scratch = torch.empty_like(out)
    _read_sum(read, plan, replica, piece, scratch, window)
    total = Sums()
    for _, where in _blocks(piece, list(plan.shard_shape), window):
        total.add(pair_sums(_narrow(scratch, where), _narrow(out, where)), 0)
    return ReplicaGap(ranks=f"rank {replica[0].rank} vs rank {piece.coords.rank}", sums=total)
