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

from megalign.alignment.dump.format import TensorRecord

from megalign.alignment.dump.reader import Dump, RankManifest
from megalign.alignment.compare.metrics import max_abs_diff
from megalign.alignment.dump.sharding import merge_cp, merge_tp
from megalign.alignment.compare.entries import Value
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
    def concat_cp(parts, dim: int):
        return merge_cp(parts, dim)

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
    def concat_cp(parts, dim: int) -> TensorStats:
        return TensorStats.combine(parts)

    @staticmethod
    def replica_diff(reference, other) -> Optional[float]:
        return None  # summaries of replicas are not worth a warning of their own


def reassemble(dump: Dump, shards: list[Shard]) -> Value:
    layout = dump.layout()
    first = shards[0].record
    sharding = first.sharding
    stats_only = first.file is None
    ops = _StatsOps() if stats_only else _TensorOps(dump)
    value = Value(shape=full_shape(shards, layout["cp"]), dtype=first.dtype)

    by_cp: dict[int, list[Shard]] = defaultdict(list)
    for shard in shards:
        by_cp[shard.rank.coords.cp_rank].append(shard)
    pieces, diffs = [], []
    for cp_rank in sorted(by_cp):
        group = sorted(by_cp[cp_rank], key=lambda s: s.rank.coords.tp_rank)
        if sharding.tp_dim is not None:
            if len(group) != layout["tp"]:
                value.problem = f"has {len(group)} of {layout['tp']} TP shards on CP rank {cp_rank}"
                return value
            pieces.append(ops.concat_tp([ops.load(s) for s in group], sharding.tp_dim, sharding.tp_parts))
        else:
            pieces.append(first_replica([ops.load(s) for s in group], diffs, ops.replica_diff))

    if sharding.seq_dim is not None and layout["cp"] > 1:
        if len(pieces) != layout["cp"]:
            value.problem = f"has {len(pieces)} of {layout['cp']} CP pieces"
            return value
        full = ops.concat_cp(pieces, sharding.seq_dim)
    else:
        full = first_replica(pieces, diffs, ops.replica_diff)
    if stats_only:
        value.stats = full
    else:
        value.tensor = full
    known = [d for d in diffs if d is not None]
    value.replica_diff = max(known) if known else None
    return value


def first_replica(replicas: list, diffs: list, differ=max_abs_diff):
    """The first replica, after recording how far `differ` finds the others from it."""
    diffs.extend(differ(replicas[0], other) for other in replicas[1:])
    return replicas[0]


def full_shape(shards: list[Shard], cp: int) -> list[int]:
    """The reassembled shape, from the records alone (also for stats-only dumps)."""
    record = shards[0].record
    shape = list(record.shape)
    sharding = record.sharding
    if sharding.tp_dim is not None:
        tp_shards = sum(1 for s in shards if s.rank.coords.cp_rank == shards[0].rank.coords.cp_rank)
        shape[sharding.tp_dim] *= tp_shards
    if sharding.seq_dim is not None and cp > 1:
        shape[sharding.seq_dim] *= cp
    return shape
