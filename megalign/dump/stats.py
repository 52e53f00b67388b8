"""Per-tensor statistics for `--stats-only` dumps.

Only sums, extremes and counts are stored, so that the statistics of a sharded tensor can be
combined from its shards exactly as the tensor itself would be reassembled.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from typing import Callable, Iterable, Union

import torch

CHUNK = 1 << 20  # elements summed at a time on a CPU (4 MiB of float32)


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
        """On a CPU, one compiled pass a chunk, every sum in float64 (_host_stats). On a device, sums
        accumulate in float32 through torch's cascade summation and in float64 across chunks (about
        1e-7 relative; seen: 1e-7 on 2e7 normal values). vector_norm is avoided: its float32
        accumulation lost 0.2% on the same values."""
        x = tensor.detach().flatten()
        if not x.is_floating_point():
            x = x.double()  # token ids and masks: small, and exact in float64
        if x.device.type == "cpu":
            return cls(tensor.numel(), *_host_stats(x))
        total, sum_sq, abs_sum = _sums(x)
        nan = inf = 0
        if not (math.isfinite(total) and math.isfinite(sum_sq)):  # a NaN or Inf somewhere (or overflow)
            nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            x = x[torch.isfinite(x)].to(torch.float64)
            total, sum_sq, abs_sum = _sums(x)
        if x.numel() == 0:  # empty, or nothing finite
            return cls(numel=tensor.numel(), sum=0.0, sum_sq=0.0, abs_sum=0.0, min=math.nan, max=math.nan,
                       nan=nan, inf=inf)
        low, high = torch.aminmax(x)
        return cls(numel=tensor.numel(), sum=total, sum_sq=sum_sq, abs_sum=abs_sum, min=float(low), max=float(high),
                   nan=nan, inf=inf)

    @classmethod
    def from_summary(cls, numel: int, summary: list[float]) -> "TensorStats":
        """From device_summary's values, read back."""
        total, sum_sq, abs_sum, low, high, nan, inf = summary
        if nan + inf == numel:  # empty, or nothing finite
            low = high = math.nan
        return cls(numel=numel, sum=total, sum_sq=sum_sq, abs_sum=abs_sum, min=low, max=high, nan=int(nan), inf=int(inf))

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
        # Not dataclasses.asdict, which deep-copies each value: 8% of a stats-only training loop's time.
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, raw: dict) -> "TensorStats":
        return cls(**raw)


_FIELDS = tuple(field.name for field in fields(TensorStats))


def _sums(x: torch.Tensor) -> tuple[float, float, float]:
    """Sum, sum of squares and sum of absolute values of a flat device tensor, in the accumulating
    dtype (bf16 squared in bf16 would round every square)."""
    buffer = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return float(buffer.sum()), float(buffer.mul(buffer).sum()), float(buffer.abs().sum())


def _host_stats(x: torch.Tensor) -> tuple[float, float, float, float, float, int, int]:
    """(sum, sum of squares, sum of |x|, min, max) over a flat CPU tensor's finite values, its NaN and
    Inf counts: CHUNK elements at a time, bf16 and fp16 widened into one reused float32 buffer (numpy
    has no bf16; a whole-tensor copy costs a page fault per 4 KiB). The sums in one compiled pass and
    numpy's min and max, not torch's reductions: seven of them a tensor, each with its dispatch, were
    25% of a stats-only training loop's time on a CPU (cProfile, bench_trainer's model). The extremes
    are not in the compiled loop: a min and max there keep LLVM from vectorizing it (7x slower,
    measured), and numpy's are vectorized."""
    from megalign.dump.host_kernels import careful_stats, fast_sums  # numba: imported where first needed

    total = sum_sq = abs_sum = 0.0
    low, high, nan, inf = math.inf, -math.inf, 0, 0
    widen = x.dtype not in (torch.float32, torch.float64)
    scratch = torch.empty(min(CHUNK, x.numel()), dtype=torch.float32) if widen else None
    for start in range(0, x.numel(), CHUNK):
        piece = x[start:start + CHUNK]
        values = (scratch[:piece.numel()].copy_(piece) if widen else piece).numpy()
        part = (*fast_sums(values), float(values.min()), float(values.max()), 0, 0)
        if not (math.isfinite(part[0]) and math.isfinite(part[1])):  # a NaN or Inf here (or overflow)
            part = careful_stats(values)
        total, sum_sq, abs_sum = total + part[0], sum_sq + part[1], abs_sum + part[2]
        low, high, nan, inf = min(low, part[3]), max(high, part[4]), nan + part[5], inf + part[6]
    if nan + inf == x.numel():  # empty, or nothing finite
        low = high = math.nan
    return total, sum_sq, abs_sum, low, high, nan, inf


def device_summary(tensor: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """A device tensor's statistics as one float64 tensor on the device (sum, sum of squares, sum of
    absolute values, min, max, NaN count, Inf count, over its finite values), queued without waiting
    for them: TensorStats.of reads each back at once, a sync per value that stalls a GPU's step.
    `fused`, on a GPU: one fused reduction that reads the tensor once, made by torch.compile on
    first use (seconds, once a dtype; written by hand it would be a Triton kernel to keep), where
    eagerly it is twenty kernels and several whole-tensor temporaries on every tensor of every step.
    Where it cannot be compiled, eagerly."""
    x = tensor.detach().reshape(-1)
    if not x.is_floating_point():
        x = x.double()
    return _summarize(x) if fused else _summary(x)


ROW = 4096  # elements reduced together first: the rows are reduced side by side, then their results


def _summary(x: torch.Tensor) -> torch.Tensor:
    """In two stages, so that a compiled kernel spreads the first over the whole GPU: a reduction of
    the flat tensor straight to a scalar, its length unknown at compile time, ran in one block
    (6 ms a tensor on the H200, measured: 28x the step it dumped)."""
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.numel()
    rows = -(-n // ROW)
    padded = torch.nn.functional.pad(x, (0, rows * ROW - n)).view(rows, ROW)
    real = torch.arange(rows * ROW, device=x.device).view(rows, ROW) < n
    finite = torch.isfinite(padded) & real
    kept = torch.where(finite, padded, 0).to(accumulate)
    nan = (torch.isnan(padded) & real).sum()
    return torch.stack([kept.sum(1).sum().double(), (kept * kept).sum(1).sum().double(),
                        kept.abs().sum(1).sum().double(), torch.where(finite, padded, math.inf).amin(1).min().double(),
                        torch.where(finite, padded, -math.inf).amax(1).max().double(), nan.double(),
                        (n - finite.sum() - nan).double()])


_compiled: Union[Callable, None, bool] = None  # _summary compiled on first use (seconds, once a dtype); False: it would not


def _summarize(x: torch.Tensor) -> torch.Tensor:
    global _compiled
    # Small tensors eagerly: compiled, every length up to ROW would be compiled again (one row).
    if x.device.type == "cuda" and x.numel() > 16 * ROW and _compiled is not False:
        try:
            if _compiled is None:
                _compiled = torch.compile(_summary, dynamic=True, fullgraph=True)
            return _compiled(x)
        except Exception as error:  # no Triton, no compiler: the same values, eagerly
            warnings.warn(f"megalign: device statistics are taken eagerly, torch.compile failed ({error})")
            _compiled = False
    return _summary(x)
