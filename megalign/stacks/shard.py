"""What one rank holds of a parameter's full tensor, and where in the flattened full tensor it lies.

megatron splits a TP parameter into contiguous slices of its `partition_dim`; a fused one (SwiGLU's
gate|up, partition stride 2) is split part by part, each rank holding its slice of every part. `of`
cuts a full tensor so (the inverse of sharding.merge_tp); `runs` says which stretches of the
flattened full tensor the cut reads, so that a source can produce only those (seeded.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megalign.dump.sharding import REPLICATED, Sharding
from megalign.errors import UserError


@dataclass(frozen=True)
class ParamShard:
    shape: tuple[int, ...]  # the full tensor's
    sharding: Sharding = REPLICATED
    tp_rank: int = 0
    tp_size: int = 1
    dtype: torch.dtype = torch.float32  # the parameter's
    device: torch.device = torch.device("cpu")  # the parameter's

    @property
    def whole(self) -> bool:
        return self.sharding.tp_dim is None or self.tp_size == 1

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor, in the parameter's dtype and on its device."""
        if self.whole:
            return full.to(self.device, self.dtype)
        dim = self.sharding.tp_dim
        parts = full.chunk(self.sharding.tp_parts, dim=dim)
        mine = torch.cat([p.chunk(self.tp_size, dim=dim)[self.tp_rank] for p in parts], dim=dim)
        return mine.to(self.device, self.dtype)

    def runs(self) -> tuple[torch.Tensor, int]:
        """(starts, length): the shard is read from the flattened full tensor's [start, start + length)."""
        if self.whole:
            return torch.zeros(1, dtype=torch.long), _numel(self.shape)
        dim = self.sharding.tp_dim
        outer, size, inner = _numel(self.shape[:dim]), self.shape[dim], _numel(self.shape[dim + 1:])
        part = size // self.sharding.tp_parts
        width = part // self.tp_size
        firsts = torch.arange(self.sharding.tp_parts) * part + self.tp_rank * width
        starts = (torch.arange(outer)[:, None] * size + firsts[None, :]) * inner
        return starts.flatten(), width * inner


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


WeightSource = Callable[[str, ParamShard], torch.Tensor]


def from_full(full: Callable[[str, tuple], torch.Tensor]) -> WeightSource:
    """A source of full tensors (a checkpoint's), cut to each rank's shard."""

    def shard_of(name: str, shard: ParamShard) -> torch.Tensor:
        value = full(name, shard.shape)
        if tuple(value.shape) != shard.shape:
            raise UserError(f"weight {name}: expected shape {shard.shape}, got {tuple(value.shape)}")
        return shard.of(value)

    return shard_of
