"""Per-tensor statistics for `--stats-only` dumps.

Only sums, extremes and counts are stored, so that the statistics of a sharded tensor can be
combined from its shards exactly as the tensor itself would be reassembled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class TensorStats:
    numel: int
    sum: float
    sum_sq: float
    abs_sum: float
    min: float
    max: float
    nan: int
    inf: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorStats":
        x = tensor.detach().to(torch.float64)
        finite = x[torch.isfinite(x)]
        empty = finite.numel() == 0
        return cls(numel=x.numel(), sum=float(finite.sum()), sum_sq=float((finite * finite).sum()),
                   abs_sum=float(finite.abs().sum()),
                   min=math.nan if empty else float(finite.min()), max=math.nan if empty else float(finite.max()),
                   nan=int(torch.isnan(x).sum()), inf=int(torch.isinf(x).sum()))

    @classmethod
    def combine(cls, shards: Iterable["TensorStats"]) -> "TensorStats":
        shards = list(shards)
        return cls(numel=sum(s.numel for s in shards), sum=sum(s.sum for s in shards),
                   sum_sq=sum(s.sum_sq for s in shards), abs_sum=sum(s.abs_sum for s in shards),
                   min=min(s.min for s in shards), max=max(s.max for s in shards),
                   nan=sum(s.nan for s in shards), inf=sum(s.inf for s in shards))

    @property
    def mean(self) -> float:
        return self.sum / max(self.numel, 1)

    @property
    def norm(self) -> float:
        return math.sqrt(self.sum_sq)

    @property
    def std(self) -> float:
        n = max(self.numel, 1)
        return math.sqrt(max(self.sum_sq / n - self.mean ** 2, 0.0))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "TensorStats":
        return cls(**raw)
