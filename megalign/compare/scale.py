"""Whether one side is a rescaled copy of the other: a loss normalised over the wrong count of tokens
(DP with uneven masks, CP with a local mean) multiplies every gradient by one factor.

The relative difference (metrics.py) hardly sees a small factor: y = s*x gives (s-1)^2 / (1+s^2),
0.0769 for s = 1.5, under the bf16 parameter-gradient threshold of 0.1 that rounding needs. The ratio
of the two norms reads s itself. Independent rounding errors of relative size u move it by about
u/sqrt(n) only, but rounding is not all independent, so the tolerance is max(FLOOR, SPREAD/sqrt(n)),
both measured (TOLERANCE). The sums are compared too where both are far from zero against the norms
(|mean| at least half the root-mean-square: a tensor mostly of one sign), where rounding moves their
ratio about as little; elsewhere a sum is a cancellation, whose ratio means nothing.

A ratio's deviation is max(r, 1/r) - 1, the same for a factor s and 1/s; a sum that changed sign is
infinitely off. Both sides float64: no check, as the fp64 thresholds (1e-16) already fail any factor
beyond 1 +- 1.4e-8.

One tensor's bf16 norm moves by several percent from rounding alone, so a factor 1.05 hides in it. But
a wrong loss normalisation rescales every gradient by the same factor, while rounding scatters the
ratios both ways: the median ratio of a kind's tensors (check_kinds) reads the factor to a fraction of
a percent, and fails the kind as a whole.

A factor is only said where it explains the difference: B against A times the norm ratio s = |B|/|A|
leaves the relative difference 1 - 2*s*sum(xy) / (s^2 |A|^2 + |B|^2) = 1 - cosine, rounding where that
is within the tensor's threshold (explained). A label shift, dropout, another data shard or a
permutation moves the norms too, but what they leave after any factor is far over the threshold: not a
scale. Such a row fails on its relative difference (never below 1 - cosine), and is no part of its
kind's median or of a pool of small tensors. --stats-only summaries hold no cosine: their ratios are
judged alone.

Where a tensor is so small that its tolerance is UNVERIFIED or wider (a bf16 norm gradient of 64
elements: 9/8), and its threshold lets a factor 1.5 through too (bf16 gradients: 0.1 against 0.077),
nothing verifies its scale. Such a row says so, and a
step's small tensors of one kind are judged together (check_small): their pooled norm ratio,
sqrt(sum |B|^2 / sum |A|^2), against the tolerance their own ones give the pool, sqrt(sum (w*t)^2)
for weights w = |A|^2 / sum |A|^2 (independent deviations, each of tolerance t, averaged with those
weights). Where even the pool's tolerance is that wide, the summary says that their scale is unverified.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from megalign.compare.metrics import StatsMetrics, TensorMetrics
from megalign.dump.format import REPEAT, STEPPED, Kind

# precision -> (FLOOR, SPREAD), from SmolLM2-135M, transformers against megatron-core at TP=3, CP=2, TP=3+SP,
# PP=2 and packed rows, over 28 texts (bench/calibrate.py, docs/compare.md "Verdicts on a real model"): each
# is twice the largest deviation seen, and 12 texts not fitted on stay within them.
# fp32: parameter gradients deviate up to 2.7e-4 on the 576-element norm weights (the massive-activation
# channel), 2.7e-5 on the 1.8M-element matrices; deviation*sqrt(n) reaches 0.0066 on what FLOOR does not
# cover -> FLOOR 6e-5, SPREAD 0.015. A factor 1.001 fails on every tensor over 225 elements.
# bf16: rounding is far from independent: norm weights deviate up to 0.55 (576 elements, fp32 against
# bf16 weights), the 1.8M-element matrices up to 0.078 between the stacks on some texts -> SPREAD 27,
# FLOOR 0.18. A factor 1.5 fails on every matrix over 2,916 elements; 1.1 is within what bf16 rounding
# does to one gradient (check_kinds catches it as a whole).
TOLERANCE = {"fp32": (6e-5, 0.015), "bf16": (0.18, 27.0)}
ONE_SIGNED = 0.5  # |mean| / rms from which a tensor's sum is compared
# The kinds a loss normalised over the wrong count rescales as a whole; the median of their norm ratios
# is judged from WHOLE_LEAST tensors of one step, at WHOLE_TOLERANCE. Measured on SmolLM2 over the same
# texts and layouts: the median deviates up to 0.032 at bf16 (megatron-core CP=2 against transformers, 182
# gradients: a bias of the stacks' bf16 rounding on some texts, 0.011 at most on others) and 5e-6 at fp32.
WHOLE_KINDS = (Kind.PARAM_GRAD, Kind.ACTIVATION_GRAD)
WHOLE_LEAST = 8
WHOLE_TOLERANCE = {"fp32": 1e-4, "bf16": 0.065}
# A tolerance from which a factor 1.5 passes: the check verifies nothing it is for (check_small).
UNVERIFIED = 0.5
# a step's name (step1/...) or a later step's repeat of a name (a loop's add() outside step blocks)
_STEP = re.compile(rf"^step\d+/|{REPEAT.pattern}")


@dataclass
class Scale:
    norm_ratio: float  # |B| / |A|
    sum_ratio: Optional[float]  # sum(B) / sum(A) where both are far from zero, else None
    tolerance: float  # the deviation either ratio may have
    off: bool
    precision: str  # the comparison's, which set the tolerance
    # The tolerance lets a factor 1.5 through, and so does the row's threshold: nothing verifies the scale.
    unverified: bool = False

    def note(self) -> str:
        sums = f", sum ratio {self.sum_ratio:.6g}" if self.sum_ratio is not None else ""
        return f"rescaled: norm ratio B/A {self.norm_ratio:.6g}{sums}, tolerance ±{self.tolerance:.2g}"

    def unverified_note(self) -> str:
        return f"scale unverified alone at {self.precision}: tolerance ±{self.tolerance:.2g}"


def tolerance(precision: str, n: int) -> float:
    floor, spread = TOLERANCE[precision]
    return max(floor, spread / math.sqrt(max(n, 1)))


def check_scale(precision: str, n: int, metrics: Union[TensorMetrics, StatsMetrics],
                threshold: float) -> Optional[Scale]:
    """The scale check of a pair of `n` elements each (values, or --stats-only summaries) whose relative
    difference may reach `threshold`; None at fp64, and where a side's norm is not known exactly (a
    --stats-only partial sum keeps only its sketch: metrics.sketch_metrics)."""
    if precision not in TOLERANCE or math.isnan(metrics.norm_a) or math.isnan(metrics.norm_b):
        return None
    sums = (metrics.sum_a, metrics.sum_b) if isinstance(metrics, TensorMetrics) else \
        (metrics.mean_a * n, metrics.mean_b * n)
    norm_ratio, sum_ratio = ratios(n, (metrics.norm_a, metrics.norm_b), sums)
    limit = tolerance(precision, n)
    off = (explained(metrics, threshold) and (n > 1 or _rank_count_factor(norm_ratio, limit))
           and any(not (deviation(r) <= limit) for r in (norm_ratio, sum_ratio) if r is not None))
    # y = s*x has the relative difference (s-1)^2 / (1+s^2) (metrics.py): what a threshold lets through.
    unverified = limit >= UNVERIFIED and threshold >= UNVERIFIED ** 2 / (1 + (1 + UNVERIFIED) ** 2)
    return Scale(norm_ratio=norm_ratio, sum_ratio=sum_ratio, tolerance=limit, off=off, precision=precision,
                 unverified=unverified)


def _rank_count_factor(ratio: float, limit: float) -> bool:
    """One number is a rescaled copy of any other: it says rescaled only by a factor a layout makes, a
    whole number (of ranks, of micro-batches) or its reciprocal: a CP loss divided by a local count is 2x,
    a loss with its labels shifted 0.98x is no factor."""
    if not math.isfinite(ratio) or ratio <= 0:
        return False
    k = max(ratio, 1 / ratio)
    return round(k) >= 2 and abs(k / round(k) - 1) <= limit


def explained(metrics: Union[TensorMetrics, StatsMetrics], threshold: float) -> bool:
    """Whether a factor explains the difference: B against A rescaled to B's norm differs by rounding
    only (the module's docstring); a --stats-only pair's is not known, and taken as one."""
    return isinstance(metrics, StatsMetrics) or 1 - metrics.cosine <= threshold


@dataclass
class KindScale:
    """A kind's tensors of one step, rescaled as a whole: their median norm ratio B/A."""
    kind: str
    step: str  # "" for the first step, "@k" for a later one, " stepN" in a dump that names its steps
    median_ratio: float
    tensors: int
    tolerance: float

    def note(self) -> str:
        """The summary's line."""
        return (f"{self.kind}{self.step} rescaled as a whole: median norm ratio B/A {self.median_ratio:.6g} "
                f"over {self.tensors} tensors, tolerance ±{self.tolerance:.2g}")

    def row_note(self) -> str:
        """Each of its rows' note: short, as a note under an 80-column table is one line."""
        return f"rescaled as a whole: median norm ratio B/A {self.median_ratio:.4g}"


@dataclass
class SmallScale:
    """A step's tensors of one kind too small for the scale check alone (Scale.unverified), judged as one."""
    kind: str
    step: str  # as KindScale's
    norm_ratio: float  # sqrt(sum |B|^2 / sum |A|^2)
    tensors: int
    tolerance: float
    off: bool
    precision: str

    @property
    def unverified(self) -> bool:
        return self.tolerance >= UNVERIFIED

    def note(self) -> str:
        """The summary's line."""
        what = f"{self.kind}{self.step} tensors" if self.kind else "tensors"  # plain files name no kind
        pooled = f"{self.tensors} {what} too small to check alone, pooled"
        if self.unverified and not self.off:
            return (f"{pooled}: tolerance ±{self.tolerance:.2g} at {self.precision}, wider than a factor "
                    f"{1 + UNVERIFIED:g}: their scale is not verified")
        return f"{pooled}: norm ratio B/A {self.norm_ratio:.6g}, tolerance ±{self.tolerance:.2g}"

    def row_note(self) -> str:
        return f"rescaled with the small tensors: pooled norm ratio B/A {self.norm_ratio:.4g}"


def check_small(judged: Iterable[tuple[int, str, str, Scale, float, float]]) -> list[tuple[SmallScale, list[int]]]:
    """Each step's and kind's small tensors pooled (the module's docstring), each pool with its rows' keys,
    from (key, kind, name, scale, |A|, |B|) of every row the scale check judged."""
    groups: dict[tuple[str, str, str], dict[int, tuple[Scale, float, float]]] = {}
    for key, kind, name, scale, norm_a, norm_b in judged:
        if scale.unverified and math.isfinite(norm_a) and math.isfinite(norm_b):
            groups.setdefault(_group(kind, name, scale.precision), {})[key] = (scale, norm_a, norm_b)
    pools = []
    for (kind, step, precision), found in groups.items():
        squares_a = sum(a * a for _, a, _ in found.values())
        ratio = _ratio(math.sqrt(squares_a), math.sqrt(sum(b * b for _, _, b in found.values())))
        limit = max(TOLERANCE[precision][0], math.sqrt(sum((a * a / squares_a * scale.tolerance) ** 2
                                                       for scale, a, _ in found.values()))) if squares_a else math.inf
        off = not deviation(ratio) <= limit
        pools.append((SmallScale(kind=kind, step=step, norm_ratio=ratio, tensors=len(found), tolerance=limit, off=off,
                                 precision=precision), list(found)))
    return pools


def check_kinds(judged: Iterable[tuple[int, str, str, Scale]]) -> list[tuple[KindScale, list[int]]]:
    """The kinds (of WHOLE_KINDS, per step) whose median norm ratio is off, each with its rows' keys,
    from (key, kind, name, scale) of every row the scale check judged."""
    groups: dict[tuple[str, str, str], dict[int, float]] = {}
    for key, kind, name, scale in judged:
        if kind in WHOLE_KINDS and 0 < scale.norm_ratio < math.inf:
            groups.setdefault(_group(kind, name, scale.precision), {})[key] = scale.norm_ratio
    off = []
    for (kind, step, precision), found in groups.items():
        median = statistics.median(found.values())
        limit = WHOLE_TOLERANCE[precision]
        if len(found) >= WHOLE_LEAST and not deviation(median) <= limit:
            off.append((KindScale(kind=kind, step=step, median_ratio=median, tensors=len(found), tolerance=limit),
                        list(found)))
    return off


def _group(kind: str, name: str, precision: str) -> tuple[str, str, str]:
    """(kind, step, precision): the step as KindScale.step says it. Gradients as the optimizer
    stepped on them (a clip's scale in every one) are a pool apart from the reduced ones."""
    step = _STEP.search(name)
    label = "" if not step else step.group() if step.group().startswith("@") else f" {step.group()[:-1]}"
    return kind, label + (f" {STEPPED}" if name.endswith(STEPPED) else ""), precision


def ratios(n: int, norms: tuple[float, float], sums: tuple[float, float]) -> tuple[float, Optional[float]]:
    """B/A of the norms, and of the sums where both are far from zero (else None)."""
    one_signed = all(abs(s) >= ONE_SIGNED * math.sqrt(n) * norm for s, norm in zip(sums, norms))
    return _ratio(*norms), _ratio(*sums) if one_signed else None


def deviation(ratio: float) -> float:
    return max(ratio, 1 / ratio) - 1 if ratio > 0 else math.inf


def _ratio(a: float, b: float) -> float:
    if a == 0:
        return 1.0 if b == 0 else math.inf
    return b / a
