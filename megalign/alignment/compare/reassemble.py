"""Put one tensor of a megalign dump back together from the shards of all ranks that hold it.

For each CP rank, TP shards are concatenated on tp_dim in tp_rank order (tp_dim None: the TP ranks
hold replicas; they are checked against each other and tp_rank 0's copy is used). Then, for a
tensor with a sequence dim under CP, the CP pieces are un-zigzagged in cp_rank order; otherwise the
CP ranks hold replicas too (parameter gradients after DDP's all-reduce, the loss). Under PP a name
lives on one stage, whose ranks are exactly the shards given. Stats-only records are combined the
same way, with TensorStats.combine in place of concatenation.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from megalign.alignment.compare.entries import Value
from megalign.alignment.compare.metrics import max_abs_diff
from megalign.alignment.dump.format import TensorRecord
from megalign.alignment.dump.reader import Dump, RankManifest
from megalign.alignment.dump.sharding import merge_cp, merge_tp
from megalign.alignment.dump.stats import TensorStats


@dataclass
class Shard:
    rank: RankManifest
    record: TensorRecord


class _TensorOps:
    def __init__(self, dump: Dump):
        self.dump = dump

    def load(self, shard: Shard):
        return self.dump.load(shard.rank, shard.record)

    @staticmethod
    def concat_tp(parts, dim: int, tp_parts: int):
        return merge_tp(parts, dim, tp_parts)

    @staticmethod
    def concat_cp(parts, dim: int, bounds):
        return merge_cp(parts, dim, bounds)

    @staticmethod
    def replica_diff(reference, other) -> Optional[float]:
        return max_abs_diff(reference, other)


class _StatsOps:
    @staticmethod
    def load(shard: Shard) -> TensorStats:
        return shard.record.stats

    @staticmethod
    def concat_tp(parts, dim: int, tp_parts: int) -> TensorStats:
        return TensorStats.combine(parts)

    @staticmethod
    def concat_cp(parts, dim: int, bounds) -> TensorStats:
        return TensorStats.combine(parts)

    @staticmethod
    def replica_diff(reference, other) -> Optional[float]:
        return None  # summaries of replicas are not worth a warning of their own


class _Missing(ValueError):
    """Shards are missing, or replicas differ in shape: the tensor cannot be put back together."""


def reassemble(dump: Dump, shards: list[Shard]) -> Value:
    layout = dump.layout()
    first = shards[0].record
    stats_only = first.file is None
    ops = _StatsOps() if stats_only else _TensorOps(dump)
    value = Value(shape=full_shape(shards, layout), dtype=first.dtype)
    diffs: list = []
    try:
        by_dp = _group(shards, "dp_rank")
        pieces = [_assemble_dp_rank(by_dp[rank], layout, dump.cp_bounds(rank), ops, diffs) for rank in sorted(by_dp)]
        full = _join(pieces, first.sharding.dp_dim, layout.get("dp", 1), "DP", ops.concat_tp, ops, diffs)
    except _Missing as e:
        value.problem = str(e)
        return value
    if stats_only:
        value.stats = full
    else:
        value.tensor = full
    known = [d for d in diffs if d is not None]
    value.replica_diff = max(known) if known else None
    return value


def _assemble_dp_rank(shards: list[Shard], layout: dict, cp_bounds, ops, diffs: list):
    """One DP rank's tensor: TP shards (or SP pieces) joined per CP rank, then the CP pieces un-zigzagged
    (document by document in a packed row, at `cp_bounds`)."""
    sharding = shards[0].record.sharding
    by_cp = _group(shards, "cp_rank")
    pieces = []
    for cp_rank in sorted(by_cp):
        group = sorted(by_cp[cp_rank], key=lambda s: s.rank.coords.tp_rank)
        loaded = [ops.load(s) for s in group]
        if sharding.sp:
            pieces.append(_join(loaded, sharding.seq_dim, layout["tp"], f"SP (on CP rank {cp_rank})",
                                ops.concat_tp, ops, diffs))
        elif sharding.tp_dim is not None:
            if len(group) != layout["tp"]:
                raise _Missing(f"has {len(group)} of {layout['tp']} TP shards on CP rank {cp_rank}")
            pieces.append(ops.concat_tp(loaded, sharding.tp_dim, sharding.tp_parts))
        else:
            pieces.append(first_replica(loaded, diffs, ops.replica_diff))
    if sharding.seq_dim is not None and layout["cp"] > 1:
        if len(pieces) != layout["cp"]:
            raise _Missing(f"has {len(pieces)} of {layout['cp']} CP pieces")
        return ops.concat_cp(pieces, sharding.seq_dim, cp_bounds)
    return first_replica(pieces, diffs, ops.replica_diff)


def _join(pieces: list, dim, size: int, axis: str, concat, ops, diffs: list):
    """Pieces split on `dim` over `size` ranks are concatenated in rank order; with no dim they are replicas."""
    if dim is None or size == 1:
        return first_replica(pieces, diffs, ops.replica_diff)
    if len(pieces) != size:
        raise _Missing(f"has {len(pieces)} of {size} {axis} pieces")
    return concat(pieces, dim, 1)


def _group(shards: list[Shard], coord: str) -> dict[int, list[Shard]]:
    groups: dict[int, list[Shard]] = defaultdict(list)
    for shard in shards:
        groups[getattr(shard.rank.coords, coord)].append(shard)
    return groups


def first_replica(replicas: list, diffs: list, differ=max_abs_diff):
    """The first replica, after recording how far `differ` finds the others from it."""
    shapes = {tuple(getattr(r, "shape", ())) for r in replicas}
    if len(shapes) > 1:
        raise _Missing(f"has replicas of different shapes {sorted(shapes)}: not the same tensor on every rank")
    diffs.extend(differ(replicas[0], other) for other in replicas[1:])
    return replicas[0]


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
