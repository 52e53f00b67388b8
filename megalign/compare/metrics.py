"""How far apart two tensors are: every sum in float64, in one pass over both (fused.py).

The relative difference is DeepGEMM's / sglang's `1 - 2*sum(x*y) / sum(x*x + y*y)`, computed in
the algebraically equal form `sum((x-y)^2) / sum(x*x + y*y)`, which does not lose the small value
to cancellation against 1. It is about eps^2/2 for a relative error eps (1e-8 means ~1.4e-4), and
0.2 for y = 2x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from megalign.compare import fused
from megalign.dump.stats import TensorStats

CHUNK = 1 << 18  # elements widened at a time for dtypes the fused pass does not read (2 MiB of float64)


@dataclass
class _Agreement:
    """What every comparison reports: the scored relative difference and the NaN/Inf counts."""

    # What a row says of NaN/Inf alike on both sides.
    NONFINITE_ALIKE = "at the same positions on both sides"

    rel_diff: float
    nan_a: int
    nan_b: int
    inf_a: int
    inf_b: int

    @property
    def nonfinite_mismatch(self) -> bool:
        return self.nan_a != self.nan_b or self.inf_a != self.inf_b


@dataclass
class TensorMetrics(_Agreement):
    """Element-wise comparison. Differences are taken over positions finite on both sides;
    `nonfinite_diff` counts the positions where NaN/Inf differ (NaN on one side only, Inf on one
    side only, or +Inf against -Inf)."""

    max_abs_diff: float
    max_abs_index: Optional[list[int]]
    mean_abs_diff: float
    cosine: float
    norm_a: float  # the 2-norms and the sums of each side: the scale check's figures (scale.py)
    norm_b: float
    sum_a: float
    sum_b: float
    nonfinite_diff: int = 0

    @property
    def nonfinite_mismatch(self) -> bool:
        return self.nonfinite_diff > 0 or super().nonfinite_mismatch


@dataclass
class StatsMetrics(_Agreement):
    """Comparison of --stats-only summaries (see stats_metrics for the formula)."""

    NONFINITE_ALIKE = "counted alike (statistics only: their positions and signs are not recorded)"

    norm_a: float
    norm_b: float
    mean_a: float
    mean_b: float
    std_a: float
    std_b: float
    # Where both sides kept a sketch (dump/sketch.py): rel_diff is the sketch's estimate, with this
    # standard deviation (rel_diff * sqrt(2 / sketch_k)), not the norm and mean's.
    sketch_k: Optional[int] = None
    rel_diff_std: Optional[float] = None


@dataclass
class LogprobMetrics:
    """How two runs' token logprobs differ, in the figures RL users quote for train/inference mismatch.

    Over the positions that have a label (the loss mask), with delta = logprob_B - logprob_A and the
    probability ratio r = exp(delta) = p_B / p_A: max, mean and p99 of |delta|; k3 = mean((r - 1) -
    log r), the k3 estimator of KL(A || B) for tokens drawn from A (never negative, 0 iff equal);
    percentiles of r; the fraction of tokens with |delta| over 0.1 and over 1.0.
    """

    max_abs_diff: float
    mean_abs_diff: float
    p99_abs_diff: float
    worst_sequence: int
    worst_position: int
    worst_token: Optional[int]
    tokens: int  # positions compared
    k3_kl: float
    ratio_min: float
    ratio_p1: float
    ratio_p50: float
    ratio_p99: float
    ratio_max: float
    frac_over_0_1: float
    frac_over_1: float
    # Where a position outside the loss mask (a rollout's prompt logprobs) is further off than any inside
    # it: the row fails on it, while the figures above, over the mask, may all be 0.
    outside_max_abs_diff: Optional[float] = None
    outside_sequence: Optional[int] = None
    outside_position: Optional[int] = None
    outside_token: Optional[int] = None


@dataclass
class RoutingMetrics:
    """Two runs' expert choices, [..., topk] ids per token: how many tokens kept their top-k set, and
    their order (by weight), and the first token (index without the top-k dim) whose set changed."""

    tokens: int
    same_set: int
    same_order: int
    first_flip: Optional[list[int]]

    @property
    def flipped(self) -> bool:
        return self.same_set < self.tokens


def routing_metrics(x: torch.Tensor, y: torch.Tensor) -> RoutingMetrics:
    same_set = (x.sort(dim=-1).values == y.sort(dim=-1).values).all(dim=-1)
    same_order = (x == y).all(dim=-1)
    flips = (~same_set).nonzero()
    return RoutingMetrics(tokens=same_set.numel(), same_set=int(same_set.sum()), same_order=int(same_order.sum()),
                          first_flip=flips[0].tolist() if len(flips) else None)


def rel_diff_of_sums(sum_sq_diff: float, sum_sq: float) -> float:
    """0 only where both sides are all zeros; sums that are NaN stay NaN, which fails the row."""
    if math.isnan(sum_sq_diff) or math.isnan(sum_sq):
        return math.nan
    return sum_sq_diff / sum_sq if sum_sq > 0 else 0.0


def tensor_metrics(x: torch.Tensor, y: torch.Tensor) -> TensorMetrics:
    """x and y have the same shape; any dtypes (compared in float64, fused.py)."""
    return metrics_of(pair_sums(x, y), list(x.shape))


def pair_sums(x: torch.Tensor, y: torch.Tensor) -> fused.Sums:
    """The sums of two same-shaped tensors, positions counted in x's flat order."""
    total = fused.Sums()
    for start, a, b in _float_chunks(x.reshape(-1), y.reshape(-1)):
        total.add(fused.sums(a, b), start)
    return total


def metrics_of(total: fused.Sums, shape: list[int]) -> TensorMetrics:
    """The metrics from the sums over a whole tensor of `shape` (also merged from windows of it)."""
    xx, yy, dd = total.xx, total.yy, total.dd
    xy = (xx + yy - dd) / 2
    cosine = xy / math.sqrt(xx * yy) if xx > 0 and yy > 0 else float(xx == yy)
    found = total.max_index >= 0
    unscale = total.exp if total.exp != fused.NO_EXP else 0  # the norms as the user's values have them
    return TensorMetrics(rel_diff=rel_diff_of_sums(dd, xx + yy), max_abs_diff=max(total.max_abs, 0.0),
                         max_abs_index=unravel(total.max_index, shape) if found else None,
                         mean_abs_diff=total.abs_diff / total.finite_pairs if total.finite_pairs else 0.0,
                         cosine=cosine, norm_a=math.ldexp(math.sqrt(xx), unscale),
                         norm_b=math.ldexp(math.sqrt(yy), unscale), sum_a=total.sx,
                         sum_b=total.sy, nan_a=total.nan_a, nan_b=total.nan_b, inf_a=total.inf_a, inf_b=total.inf_b,
                         nonfinite_diff=total.nonfinite_diff)


def _float_chunks(x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(start, x piece, y piece) as float32/float64 arrays: float32 and float64 tensors whole, as they
    are; other dtypes widened exactly, CHUNK elements at a time into two reused buffers (to float32
    when both are narrower floats, else float64: integers up to 2^53 are exact in it)."""
    native = (torch.float32, torch.float64)
    if x.dtype in native and y.dtype in native:
        yield 0, x.numpy(), y.numpy()
        return
    narrow = all(t.is_floating_point() and t.element_size() <= 4 for t in (x, y))
    n = x.numel()
    buf_a = torch.empty(min(CHUNK, n), dtype=torch.float32 if narrow else torch.float64)
    buf_b = torch.empty_like(buf_a)
    for start in range(0, n, CHUNK):
        size = min(CHUNK, n - start)
        yield start, buf_a[:size].copy_(x[start:start + size]).numpy(), buf_b[:size].copy_(y[start:start + size]).numpy()


def stats_metrics(a: TensorStats, b: TensorStats) -> StatsMetrics:
    """The relative-difference formula applied to the summaries, so thresholds keep their meaning.

    For scalars the formula is (a-b)^2 / (a^2 + b^2). It is taken for the norms, and for the means
    relative to the root-mean-squares (a mean near zero would make a plain relative difference
    meaningless); the larger is the rel_diff. The standard deviations are reported but not scored:
    they follow from the same two sums (std^2 = rms^2 - mean^2), and that subtraction turns the
    sums' float32 accumulation error (stats.py) into noise far above the fp32 thresholds.
    """
    rms_a, rms_b = a.norm / math.sqrt(max(a.numel, 1)), b.norm / math.sqrt(max(b.numel, 1))
    worst = max(_scalar_rel(a.norm - b.norm, a.norm, b.norm), _scalar_rel(a.mean - b.mean, rms_a, rms_b))
    return StatsMetrics(rel_diff=worst, norm_a=a.norm, norm_b=b.norm, mean_a=a.mean, mean_b=b.mean,
                        std_a=a.std, std_b=b.std, nan_a=a.nan, nan_b=b.nan, inf_a=a.inf, inf_b=b.inf)


def sketch_metrics(a: Optional[TensorStats], b: Optional[TensorStats], sketch_a: np.ndarray,
                   sketch_b: np.ndarray) -> StatsMetrics:
    """The relative difference estimated from two sketches: sum((x-y)^2) by ||S(x) - S(y)||^2
    (unbiased, relative std at most sqrt(2/K): dump/sketch.py), over sum(x*x + y*y) from the
    statistics, exact; from the sketches too where a side has none (a partial sum's). The norms,
    means and standard deviations are the statistics' (NaN where there are none: a sketch's norm is
    off by about sqrt(2/K), far above a scale check's tolerance)."""
    diff = np.subtract(sketch_a, sketch_b, dtype=np.float64)
    scale = float(np.abs(diff).max(initial=0.0))  # squares of tiny sketches would underflow
    diff_sq = float(np.square(diff / scale).sum()) if scale > 0 else 0.0
    norm_a, norm_b = (s.norm if s is not None else float(np.linalg.norm(k)) for s, k in ((a, sketch_a), (b, sketch_b)))
    sum_sq = (norm_a / scale) ** 2 + (norm_b / scale) ** 2 if scale > 0 else norm_a ** 2 + norm_b ** 2
    rel = rel_diff_of_sums(diff_sq, sum_sq)
    k = len(sketch_a)
    missing = TensorStats(numel=0, sum=math.nan, sum_sq=math.nan, abs_sum=math.nan, min=math.nan, max=math.nan,
                          nan=0, inf=0)
    a, b = a or missing, b or missing
    return StatsMetrics(rel_diff=rel, norm_a=a.norm, norm_b=b.norm, mean_a=a.mean, mean_b=b.mean,
                        std_a=a.std, std_b=b.std, nan_a=a.nan, nan_b=b.nan, inf_a=a.inf, inf_b=b.inf,
                        sketch_k=k, rel_diff_std=rel * math.sqrt(2 / k))


def _scalar_rel(diff: float, p: float, q: float) -> float:
    """diff^2 / (p^2 + q^2), all divided by max(|p|, |q|) first: squares of 1e-170 underflow (fused.py)."""
    scale = max(abs(p), abs(q))
    if not 0 < scale < math.inf:
        return rel_diff_of_sums(diff ** 2, p ** 2 + q ** 2)
    return rel_diff_of_sums((diff / scale) ** 2, (p / scale) ** 2 + (q / scale) ** 2)


def logprob_metrics(x: torch.Tensor, y: torch.Tensor, tokens: Optional[torch.Tensor],
                    mask: Optional[torch.Tensor] = None) -> LogprobMetrics:
    """x, y: [sequences, positions] (or flat [tokens]); tokens and mask (the loss mask): the inputs of the
    same shape, if known. Positions without a label are left out when the mask is known, but for the worst
    of them where it is further off than any position with one."""
    delta = logprob_gap(x, y)
    keep = (mask.reshape(-1) > 0 if mask is not None and mask.shape == x.shape
            else torch.ones(x.numel(), dtype=torch.bool))
    if not keep.any():
        keep = torch.ones(x.numel(), dtype=torch.bool)
    flat = delta.reshape(-1)
    _, worst_sequence, worst_position, worst_token = _worst(flat.abs(), keep, x, tokens)
    kept = flat[keep]
    absolute = kept.abs()
    ratio = kept.exp()  # inf past exp(709): a ratio beyond float64 is said as inf, not as a clamped number
    # Interpolating next to an inf gives NaN (inf * 0): then the nearest rank, which is inf or a real ratio.
    ratios = torch.quantile(ratio, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64),
                            interpolation="linear" if ratio.isfinite().all() else "nearest").tolist()
    found = LogprobMetrics(max_abs_diff=float(absolute.max()), mean_abs_diff=float(absolute.mean()),
                           p99_abs_diff=float(absolute.kthvalue(max(1, math.ceil(0.99 * absolute.numel()))).values),
                           worst_sequence=worst_sequence, worst_position=worst_position, worst_token=worst_token,
                           tokens=int(kept.numel()), k3_kl=float(k3_terms(kept).mean()),
                           ratio_min=float(ratio.min()), ratio_p1=ratios[0], ratio_p50=ratios[1], ratio_p99=ratios[2],
                           ratio_max=float(ratio.max()), frac_over_0_1=float((absolute > 0.1).double().mean()),
                           frac_over_1=float((absolute > 1.0).double().mean()))
    outside = _worst(flat.abs(), ~keep, x, tokens)
    if outside[0] > found.max_abs_diff:
        (found.outside_max_abs_diff, found.outside_sequence, found.outside_position,
         found.outside_token) = outside
    return found


def _worst(size: torch.Tensor, where: torch.Tensor, x: torch.Tensor,
           tokens: Optional[torch.Tensor]) -> tuple[float, int, int, Optional[int]]:
    """The largest of `size` (flat) where `where` holds, -1 where it holds nowhere: (value, sequence,
    position, token at it)."""
    masked = size.masked_fill(~where, -1.0)
    worst = int(masked.argmax())
    index = unravel(worst, list(x.shape)) if x.ndim >= 2 else [0, worst]
    token = int(tokens.reshape(-1)[worst]) if tokens is not None and tokens.shape == x.shape else None
    return float(masked[worst]), index[0], index[-1], token


def logprob_gap(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y - x in float64; NaN (on either side, or inf - inf) reads as inf, the worst gap. An infinite gap
    stays inf: torch's nan_to_num would make it float64's largest number, printed as if measured."""
    delta = y.to(torch.float64) - x.to(torch.float64)
    return delta.masked_fill(delta.isnan(), math.inf)


def k3_terms(delta: torch.Tensor) -> torch.Tensor:
    """(r - 1) - log r per token, r = exp(delta): inf where delta is (expm1(inf) - inf would be NaN)."""
    return torch.where(delta.isinf(), math.inf, delta.expm1() - delta)


def unravel(flat_index: int, shape: list[int]) -> list[int]:
    index = []
    for size in reversed(shape):
        flat_index, rest = divmod(flat_index, size)
        index.append(rest)
    return index[::-1]
