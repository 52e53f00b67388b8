"""The judge: a pair's verdict from its two loaded values, and the verdicts of a kind's tensors together.

Pure: what it judges is given (two Values, each a tensor or a --stats-only summary with its shape,
dtype, replicas' gaps and what kept it from being put together; the runs' dtypes; the reference's
Value), nothing is read from a file. The rules of judge_pair, in the order they apply:
- a side that could not be put back together (Value.problem): NOT_REASSEMBLABLE;
- a side whose values stand for an unrecorded reduction (Value.unverifiable): UNVERIFIABLE, but FAIL
  where no reduction a trainer uses fits the other side (no_reduction_fits);
- other shapes: SHAPE_MISMATCH;
- the threshold: thresholds.py's, at the precision of both runs (run_precision), sized for vectors;
- a side's replicas further apart than the threshold, or with NaN/Inf elsewhere: FAIL;
- a router's integer expert choices: FAIL where a token's top-k set changed (agreement, not a distance);
- the relative difference over the threshold (NaN included): FAIL; NaN/Inf counts that differ: FAIL;
  NaN/Inf alike on both sides: a note, FAIL only with strict_nonfinite;
- with a reference of the same shape: its verdict instead of the threshold (reference.py), each side's
  distance to it in full values, or estimated by sketches where a side or the reference is stats-only;
- without one, where the default threshold applies: the scale check (scale.py), FAIL when off: a
  factor that explains the difference (removing it leaves rounding), noted as `rescaled`;
A failing row whose difference sits in one DP rank's rows only says so, and a failing or misshapen one
where a DP rank's rows repeat another rank's (rank_rows.py).
judge_kinds then fails the tensors of a kind rescaled as a whole, or of a pool of small ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from megalign.compare import reference
from megalign.compare.entries import Value
from megalign.compare.metrics import (StatsMetrics, TensorMetrics, logprob_metrics, metrics_of, routing_metrics,
                                      sketch_metrics, stats_metrics, tensor_metrics)
from megalign.compare.rank_rows import RankRows, only_rank, repeated_rank
from megalign.compare.records import (APART, FAIL, NOT_REASSEMBLABLE, ONLY_A, ONLY_B, PASS, SHAPE_MISMATCH,
                                      UNVERIFIABLE, Row, Verdict)
from megalign.compare.scale import KindScale, SmallScale, check_kinds, check_scale, check_small, explained
from megalign.compare.thresholds import Thresholds, precision_of, run_precision
from megalign.dump.format import PRECISIONS, Kind
from megalign.dump.stats import TensorStats, summary_of


@dataclass
class Rules:
    """What every pair of one comparison is judged by."""

    thresholds: Thresholds
    run_a: Optional[str] = None  # each side's run dtype (Source.precision), where its format records one
    run_b: Optional[str] = None
    strict_nonfinite: bool = False  # NaN/Inf at the same positions on both sides fail too
    # The inputs, where a side holds them: a logprobs row names the token at its worst position, over
    # the positions with a label.
    tokens: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None


def judge_pair(kind: str, name: str, x: Value, y: Value, rules: Rules, truth: Optional[Value] = None,
               metrics: Optional[TensorMetrics] = None, rows: Optional[RankRows] = None) -> Verdict:
    """The verdict on A's value `x` against B's `y` (the module's docstring); `truth`: the reference's
    value; `metrics`: already computed (a pair compared a window at a time, whose Values hold no tensor);
    `rows`: which DP rank's rows each block of a batch-split side holds."""
    v = Verdict(shape_a=x.shape, shape_b=y.shape, dtype_a=x.dtype, dtype_b=y.dtype)
    problems = [f"{side}: {value.problem}" for side, value in (("A", x), ("B", y)) if value.problem]
    if problems:
        v.status = NOT_REASSEMBLABLE
        v.notes += problems
        return v
    lone = [f"{side}: is a partial sum over ranks, which only its sketch stands for, and the other side has none"
            for side, value, other in (("A", x, y), ("B", y, x))
            if value.tensor is None and value.stats is None and value.sketch is not None
            and other.tensor is None and other.sketch is None]
    if lone:
        v.status = NOT_REASSEMBLABLE
        v.notes += lone
        return v
    precision_a, precision_b = run_precision(rules.run_a, x.dtype), run_precision(rules.run_b, y.dtype)
    precision = precision_of(precision_a, precision_b)
    unverifiable = [f"{side}: {value.unverifiable}" for side, value in (("A", x), ("B", y)) if value.unverifiable]
    if unverifiable:
        threshold = rules.thresholds.for_tensor(kind, name, precision, x.shape)
        ruled_out = [f"{side}: {why}" for side, value, other in (("A", x, y), ("B", y, x))
                     if value.parts is not None and (why := no_reduction_fits(value.parts, other, threshold))]
        v.status = FAIL if ruled_out else UNVERIFIABLE
        v.notes += ruled_out or unverifiable
        return v
    if list(x.shape) != list(y.shape):
        v.status = SHAPE_MISMATCH
        if rows is not None:
            split = y if rows.side == "B" else x
            _note_repeated(v, x, y, rows, rules.thresholds.for_tensor(kind, name, precision, split.shape))
        return v
    threshold = rules.thresholds.for_tensor(kind, name, precision, x.shape)
    replicas_disagree = _judge_replicas(v, x, y, threshold)
    if _is_routing_choice(kind, x, y):
        return _judge_routing(v, x, y, replicas_disagree)
    v.dtype_mismatch = x.dtype != y.dtype  # compared in float64 all the same; said once, above the table
    for side, run, value in (("A", rules.run_a, x), ("B", rules.run_b, y)):
        if kind != Kind.INPUT and _stored_apart(run, value.dtype):  # inputs: exact anyway
            v.notes.append(f"{side}: stored as {value.dtype} by a {run} run; judged at the run's precision")
    v.threshold = threshold
    m = v.metrics = metrics or _metrics(x, y)
    if kind == Kind.LOGPROBS and x.tensor is not None and y.tensor is not None:
        v.logprobs = logprob_metrics(x.tensor, y.tensor, rules.tokens, rules.loss_mask)
    diverged = not (m.rel_diff <= v.threshold)  # NaN compares false: diverged
    if m.nan_a or m.nan_b or m.inf_a or m.inf_b:
        where = "at different positions or signs" if m.nonfinite_mismatch else m.NONFINITE_ALIKE
        v.notes.append(f"NaN/Inf {where}: A {m.nan_a} NaN {m.inf_a} Inf, B {m.nan_b} NaN {m.inf_b} Inf")
    if truth is not None and list(truth.shape) == list(x.shape) and (distances := _to_reference(x, y, truth)):
        v.reference = reference.judge(kind, x.shape, *distances, precision_a, precision_b)
        diverged = v.reference.off is not None
        v.threshold = None  # the reference judged this row, not a threshold
        if any(value.tensor is None for value in (x, y, truth)):
            v.notes.append("distances to the reference estimated by sketches")
    if v.reference is None and not rules.thresholds.overrides(name):
        v.scale = check_scale(precision, math.prod(x.shape), m, v.threshold)
    if v.scale is not None and v.scale.off:
        diverged = True
        v.notes.append(v.scale.note())
    strict = rules.strict_nonfinite and v.nonfinite_in_both
    v.status = FAIL if diverged or m.nonfinite_mismatch or replicas_disagree or strict else PASS
    if v.status == FAIL and rows is not None and v.threshold is not None and x.tensor is not None and \
            y.tensor is not None and not _note_repeated(v, x, y, rows, v.threshold) and \
            (rank := only_rank(x.tensor, y.tensor, rows, v.threshold)) is not None:
        v.notes.append(rows.note(rank))
    return v


def _note_repeated(v: Verdict, x: Value, y: Value, rows: RankRows, threshold: float) -> bool:
    """Notes a DP rank of rows.side that holds another rank's rows (rank_rows.repeated_rank); whether one does."""
    split, unsplit = (y, x) if rows.side == "B" else (x, y)
    repeated = repeated_rank(split.tensor, unsplit.tensor, rows, threshold)
    if repeated is not None:
        v.notes.append(rows.repeat_note(*repeated))
    return repeated is not None


def judge_one_sided(in_a: bool, shape: list[int], dtype: str, why: Optional[str],
                    allowed: Optional[str]) -> Verdict:
    """A tensor only one side holds: never compared, so it fails unless `allowed` (records.BY_OP_MAP or
    BY_PATTERN); `why`: what absent.py knows of its absence."""
    return Verdict(status=ONLY_A if in_a else ONLY_B, shape_a=shape if in_a else None, dtype_a=dtype if in_a else None,
                   shape_b=None if in_a else shape, dtype_b=None if in_a else dtype, allowed=allowed,
                   notes=[why] if why else [])


def judge_apart(shape_a: Optional[list[int]], shape_b: Optional[list[int]], why: str) -> Verdict:
    """A tensor that cannot be lined up token by token (lineup.py): counted, not compared."""
    return Verdict(status=APART, shape_a=shape_a, shape_b=shape_b, notes=[why])


def judge_kinds(rows: list[Row]) -> tuple[list[KindScale], list[SmallScale]]:
    """A kind rescaled as a whole (scale.check_kinds), or a pool of small tensors (scale.check_small),
    fails on each of its rows, the first of them named as the first divergence: the factor is in every
    one, under each one's own rounding. The pools that are off or stay unverified are returned too. A
    row no factor explains (scale.explained) is no part of them: its difference is of another kind."""
    judged = [row for row in rows if row.scale is not None and row.status in (PASS, FAIL) and
              explained(row.metrics, row.threshold)]
    off = check_kinds((row.index, row.kind, row.name, row.scale) for row in judged)
    pools = check_small((row.index, row.kind, row.name, row.scale, row.metrics.norm_a, row.metrics.norm_b)
                        for row in judged)
    for group, indices in off + [(pool, indices) for pool, indices in pools if pool.off]:
        for row in (rows[index] for index in indices):
            if not row.scale.off:  # a row off on its own says so already
                row.notes.append(group.row_note())
            row.status = FAIL
    said = [pool for pool, _ in pools if pool.off]
    for pool, indices in pools:
        if pool.unverified and not pool.off:
            passed = [rows[index] for index in indices if rows[index].status == PASS]  # a failed one was judged
            for row in passed:
                row.notes.append(row.scale.unverified_note())
            if passed:
                said.append(pool)
    return [whole for whole, _ in off], said


def no_reduction_fits(parts: torch.Tensor, other: Value, threshold: float) -> Optional[str]:
    """Why per-rank parts (of a loss dumped without its reduction) cannot be the other side's value
    under any reduction a trainer uses; None where one may fit. Their sum may be it (each rank's
    share), or a mean weighted by each rank's tokens, which lies strictly inside the parts' range (a
    rank with no tokens would hold no loss): a value outside both diverged, whatever the convention."""
    if other.tensor is None or list(other.tensor.shape) != list(parts.shape[1:]):
        return None
    target, parts = other.tensor.double(), parts.double()
    if tensor_metrics(parts.sum(0), target).rel_diff <= threshold:
        return None
    margin = threshold * target.abs()
    low, high = parts.min(0).values, parts.max(0).values
    if bool(((target > low + margin) & (target < high - margin)).all()):
        return None
    return (f"per-rank parts {[round(v, 6) for v in parts.flatten().tolist()[:8]]} neither sum to the other side's "
            f"{[round(v, 6) for v in target.flatten().tolist()[:4]]} nor hold it strictly between them as a "
            "token-weighted mean would")


def _judge_replicas(v: Verdict, x: Value, y: Value, threshold: float) -> bool:
    """Whether a side's replicas disagree: a copy further from the one placed than the tensor's own
    threshold (the relative difference of metrics.py), or NaN/Inf elsewhere. Notes the worst copy
    of each side, and keeps its relative difference in replica_diff_a / replica_diff_b."""
    disagree = False
    for side, value in (("A", x), ("B", y)):
        if not value.replicas:
            continue
        # NaN/Inf in other places is the worst a copy can be: an infinite difference.
        gaps = [(math.inf if m.nonfinite_mismatch else m.rel_diff, gap.ranks)
                for gap in value.replicas for m in [metrics_of(gap.sums, [])]]
        rel, ranks = max(gaps, key=lambda g: g[0])
        setattr(v, f"replica_diff_{side.lower()}", rel)
        if rel == math.inf:
            v.notes.append(f"{side}: replicas disagree on where NaN/Inf are ({ranks})")
        elif not rel <= threshold:
            v.notes.append(f"{side}: replicas disagree ({ranks}): rel diff {rel:.3g} over the threshold")
        elif rel:
            v.notes.append(f"{side}: replicas differ within the threshold ({ranks}): rel diff {rel:.3g}")
        disagree = disagree or not rel <= threshold
    return disagree


def _is_routing_choice(kind: str, x: Value, y: Value) -> bool:
    return kind == Kind.ROUTING and x.tensor is not None and y.tensor is not None and \
        not x.tensor.is_floating_point() and not y.tensor.is_floating_point()


def _judge_routing(v: Verdict, x: Value, y: Value, replicas_disagree: bool) -> Verdict:
    """Expert ids are the same or not: the row fails when a token's top-k set changed."""
    m = v.routing = routing_metrics(x.tensor, y.tensor)
    v.notes.append(f"routing: {m.same_set / m.tokens:.2%} of {m.tokens} tokens keep their top-k set, "
                   f"{m.same_order / m.tokens:.2%} its order"
                   + (f"; first flip at token {','.join(map(str, m.first_flip))}" if m.flipped else ""))
    v.status = FAIL if m.flipped or replicas_disagree else PASS
    return v


def _stored_apart(run: Optional[str], stored: str) -> bool:
    """A floating tensor stored narrower than its run computes (bf16 in an fp32 run): worth a note. Wider
    is the rule in bf16 runs (float32 main gradients, loss and logprobs), so it goes unsaid."""
    floating = isinstance(getattr(torch, stored, None), torch.dtype) and getattr(torch, stored).is_floating_point
    return bool(run) and floating and PRECISIONS.index(precision_of(stored)) < PRECISIONS.index(precision_of(run))


def _to_reference(x: Value, y: Value, truth: Value) -> Optional[tuple[float, float]]:
    """Each side's relative difference to the reference's value: in full values, or estimated from
    sketches where a side or the reference is stats-only (a zoom's tensors outside it; the estimate's
    12.5% is well within the budgets' margins, reference.py); None where a side has neither."""
    if truth.problem is not None or (truth.tensor is None and truth.sketch is None):
        return None
    distances = [_metrics(side, truth) for side in (x, y)]
    if all(isinstance(m, TensorMetrics) or m.sketch_k is not None for m in distances):
        return distances[0].rel_diff, distances[1].rel_diff
    return None


def _metrics(x: Value, y: Value) -> Union[TensorMetrics, StatsMetrics]:
    if x.tensor is not None and y.tensor is not None:
        return tensor_metrics(x.tensor, y.tensor)
    # A --stats-only side: its sketch against the other's where both have one, else the summaries.
    if (x.sketch is not None or x.tensor is not None) and (y.sketch is not None or y.tensor is not None):
        (stats_x, sketch_x), (stats_y, sketch_y) = map(_summary, (x, y))
        return sketch_metrics(stats_x, stats_y, sketch_x, sketch_y)
    return stats_metrics(*(_summary(value)[0] for value in (x, y)))


def _summary(value: Value) -> tuple[Optional[TensorStats], Optional[np.ndarray]]:
    """A side's statistics (None: a partial sum's, which only its sketch stands for) and sketch, a
    full tensor's both in one pass."""
    return (value.stats, value.sketch) if value.tensor is None else summary_of(value.tensor)
