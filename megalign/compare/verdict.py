"""Compare two sources tensor by tensor and decide which tensors diverged.

Entries are matched by (kind, name); a plain tensor file has no kinds, so its tensors match the
first tensor of the same name on the other side (in execution order: a forward activation before
the gradient of the same name). Rows come in the execution order of A (B's order for tensors only
in B). Pairs are compared on a thread pool: torch's kernels release the GIL, and only the pairs
being worked on are in memory. A big pair is cut into chunks of rows that the pool takes like pairs,
their sums merged in order: whole, the few largest pairs were each read by one thread while the
others idled (38% of the workers' time on the 8B-wide model's 60 GiB pair, py-spy on the H200).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from megalign.compare import absent
from megalign.compare.buffers import BufferPool, check_fits
from megalign.compare.entries import Entry, Source, Value, Window
from megalign.compare.fused import Sums
from megalign.compare.lineup import line_up
from megalign.compare.metrics import (LogprobMetrics, RoutingMetrics, StatsMetrics, TensorMetrics,
                                                logprob_metrics, metrics_of, pair_sums, routing_metrics, stats_metrics,
                                                tensor_metrics)
from megalign.compare.objective import on_objective_scale
from megalign.compare.reference import ReferenceVerdict, check_reference, judge
from megalign.compare.scale import KindScale, Scale, SmallScale, check_kinds, check_scale, check_small
from megalign.compare.steps import share_steps
from megalign.compare.thresholds import Thresholds, precision_of, run_precision
from megalign.dump.format import PRECISIONS
from megalign.dump.stats import TensorStats
from megalign.errors import UserError, compile_pattern

# Statuses. A tensor on one side only (ONLY_A / ONLY_B) was never compared, so it fails, unless the
# op map between stacks and attention kernels expects it there (absent.py) or the user allowed it
# (--allow-missing): then Row.allowed says which, and the summary counts it. One that could not be
# reassembled was never compared either: it fails unless the user allowed it (--allow-skipped), when
# it is SKIPPED and named in the summary. A tensor set APART (lineup.py: positions, not tokens, under
# differently packed batches) is counted. One whose values cannot be verified (Value.unverifiable) is
# UNVERIFIABLE: named apart in the summary, never a divergence, unless no reduction a trainer uses
# could give the other side's value from it (_no_reduction_fits): then it FAILs.
PASS, FAIL, SHAPE_MISMATCH = "pass", "fail", "shape_mismatch"
ONLY_A, ONLY_B, NOT_REASSEMBLABLE, SKIPPED, APART = "only_a", "only_b", "not_reassemblable", "skipped", "apart"
UNVERIFIABLE = "unverifiable"
FAILING = (FAIL, SHAPE_MISMATCH, NOT_REASSEMBLABLE)
BY_OP_MAP, BY_PATTERN = "cross-stack op map", "--allow-missing"  # Row.allowed of a one-sided row
# Pairs with a side over STREAM_BYTES are compared a window of about WINDOW_BYTES at a time (rows
# of dim 0, or where one row is larger, runs of a deeper dim within it), in chunks of CHUNK_WINDOWS
# windows that the workers take apart (_Comparison._chunk).
STREAM_BYTES, WINDOW_BYTES, CHUNK_WINDOWS = 64 << 20, 16 << 20, 4


@dataclass
class Row:
    index: int
    kind: str
    name: str
    layer: Optional[int]
    status: str = PASS
    threshold: Optional[float] = None
    shape_a: Optional[list[int]] = None
    shape_b: Optional[list[int]] = None
    dtype_a: Optional[str] = None
    dtype_b: Optional[str] = None
    dtype_mismatch: bool = False
    metrics: Union[TensorMetrics, StatsMetrics, None] = None
    logprobs: Optional[LogprobMetrics] = None
    routing: Optional[RoutingMetrics] = None  # a router's expert choices: agreement, not a difference
    replica_diff_a: Optional[float] = None  # the largest relative difference of a replica to the copy placed
    replica_diff_b: Optional[float] = None
    reference: Optional[ReferenceVerdict] = None  # with --reference: each side's distance to R, and which is off
    scale: Optional[Scale] = None  # the norms' (and sums') ratio B/A, judged where a default threshold applies
    allowed: Optional[str] = None  # ONLY_A / ONLY_B: BY_OP_MAP or BY_PATTERN, else None (the row fails)
    notes: list[str] = field(default_factory=list)

    @property
    def failing(self) -> bool:
        return self.status in FAILING or (self.status in (ONLY_A, ONLY_B) and self.allowed is None)

    @property
    def nonfinite_in_both(self) -> bool:
        """NaN/Inf on both sides at the same positions: agreement, but rarely a sane run."""
        m = self.metrics
        return m is not None and bool(m.nan_a or m.nan_b or m.inf_a or m.inf_b) and not m.nonfinite_mismatch


@dataclass
class Summary:
    compared: int
    passed: int
    failed: int
    shape_mismatch: int
    only_a: int
    only_b: int
    missing_a: int  # of only_a: those not allowed, which fail
    missing_b: int
    allowed_by_op_map: int  # one-sided rows the op map expects (absent.py)
    allowed_by_pattern: int  # one-sided rows --allow-missing names
    not_reassemblable: int
    skipped: int
    apart: int
    unverifiable: int
    first_divergence: Optional[str]  # "kind name" of the first failing row, in execution order
    # The first router whose choices differ: a cause of its own, before the numeric drift it brings.
    first_routing_flip: Optional[str]
    first_failure_by_kind: dict[str, str]  # kind -> name of its first failing row (a loss bug shows in all)
    nonfinite_in_both: list[str]  # "kind name" of rows with NaN/Inf at the same positions on both sides
    rescaled: list[KindScale]  # kinds whose tensors are rescaled as a whole (scale.check_kinds)
    # Pools of tensors too small for the scale check alone that are off, or whose scale stays unverified
    # (scale.check_small).
    small_scale: list[SmallScale]

    @property
    def ok(self) -> bool:
        return not (self.failed or self.shape_mismatch or self.not_reassemblable or self.missing_a or self.missing_b)


@dataclass
class Report:
    a: Source
    b: Source
    rows: list[Row]
    summary: Summary
    first_divergence: Optional[int]  # index into rows


@dataclass
class _Pair:
    kind: str
    name: str
    a: Optional[Entry]
    b: Optional[Entry]


class NothingCompared(UserError):
    """A comparison that compared no tensor proves nothing: exit 2, with the reason."""


def compare_sources(a: Source, b: Source, thresholds: Thresholds, name_filter: Optional[str] = None,
                    workers: Optional[int] = None, allow_skipped: Optional[str] = None,
                    reference: Optional[Source] = None, allow_missing: Optional[str] = None,
                    strict_nonfinite: bool = False) -> Report:
    """Compare every tensor of the two sources; NothingCompared when not one pair was compared.
    With `reference` (an fp64 run), the verdict is reference.py's rule instead of the thresholds.
    `strict_nonfinite`: NaN/Inf at the same positions on both sides fail too."""
    a, b, reference = share_steps(a, b, reference)  # a training loop's dumps: the steps all hold
    a, b, reference = line_up(a, b, reference)  # packed and padded batches: compared token by token
    a, b, reference = on_objective_scale(a, b, reference)  # activation gradients: by each run's reduction
    pattern = compile_pattern("--filter", name_filter) if name_filter else None
    skippable = compile_pattern("--allow-skipped", allow_skipped) if allow_skipped else None
    missable = compile_pattern("--allow-missing", allow_missing) if allow_missing else None
    matched = match_entries(a, b)
    pairs = [p for p in matched if pattern is None or pattern.search(p.name)]
    if not matched:
        raise NothingCompared("A and B hold no tensor: nothing compared")
    if not pairs:
        raise NothingCompared(f"--filter {name_filter!r} matches none of the {len(matched)} tensors: nothing compared")
    if reference is not None:
        check_reference(reference, a, b)
    comparison = _Comparison(a, b, thresholds, reference, pairs, missable, strict_nonfinite)
    rows = comparison.rows(workers or os.cpu_count() or 1)
    for row in rows:
        if row.status == NOT_REASSEMBLABLE and skippable is not None and skippable.search(row.name):
            row.status = SKIPPED
    rescaled, small = _judge_kinds(rows)
    first = next((row.index for row in rows if row.failing), None)
    report = Report(a=a, b=b, rows=rows, summary=_summarise(rows, first, rescaled, small), first_divergence=first)
    _check_something_compared(report)
    return report


def _judge_kinds(rows: list[Row]) -> tuple[list[KindScale], list[SmallScale]]:
    """A kind rescaled as a whole (scale.check_kinds), or a pool of small tensors (scale.check_small),
    fails on each of its rows, the first of them named as the first divergence: the factor is in every
    one, under each one's own rounding. The pools that are off or stay unverified are returned too."""
    judged = [row for row in rows if row.scale is not None and row.status in (PASS, FAIL)]
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


def _check_something_compared(report: Report) -> None:
    s = report.summary
    if s.compared or s.shape_mismatch or s.not_reassemblable:
        return  # a shape mismatch or an unreassemblable tensor is a verdict (exit 1), not bad input
    if s.skipped:
        raise NothingCompared(f"every shared tensor ({s.skipped}) is not reassemblable and allowed by "
                              "--allow-skipped: nothing compared")
    raise NothingCompared(f"A and B share no tensor ({s.only_a} only in A, {s.only_b} only in B): nothing compared; "
                          "are they runs of the same model?")


def match_entries(a: Source, b: Source) -> list[_Pair]:
    kindless = any(e.kind is None for e in a.entries + b.entries)
    key = (lambda e: e.name) if kindless else (lambda e: (e.kind, e.name))
    in_b: dict = {}
    for entry in sorted(b.entries, key=lambda e: e.order):
        in_b.setdefault(key(entry), entry)  # kindless: the first of a name in execution order
    pairs, matched = [], set()
    for entry in sorted(a.entries, key=lambda e: e.order):
        other = in_b.get(key(entry))
        if other is not None and id(other) in matched:
            other = None
        if other is not None:
            matched.add(id(other))
        pairs.append((entry.order, _pair(entry, other)))
    pairs += [(e.order, _pair(None, e)) for e in b.entries if id(e) not in matched]
    pairs.sort(key=lambda p: p[0])  # stable: B-only tensors fall in place by B's own order
    return [p for _, p in pairs]


def _pair(a: Optional[Entry], b: Optional[Entry]) -> _Pair:
    kind = (a.kind if a else None) or (b.kind if b else None) or "tensor"
    return _Pair(kind=kind, name=(a or b).name, a=a, b=b)


class _Comparison:
    """What every row of one comparison needs: the sources, the thresholds, the reference, the inputs."""

    def __init__(self, a: Source, b: Source, thresholds: Thresholds, reference: Optional[Source], pairs: list[_Pair],
                 missable: Optional[re.Pattern], strict_nonfinite: bool):
        self.a, self.b, self.thresholds, self.reference, self.pairs = a, b, thresholds, reference, pairs
        self.missable, self.strict_nonfinite = missable, strict_nonfinite
        self.tokens = _input(self.a, self.b, "tokens")  # to name the token at the worst logprob position
        self.loss_mask = _input(self.a, self.b, "loss_mask")
        self.in_reference = {(e.kind, e.name): e for e in self.reference.entries} if self.reference else {}
        self.sides_a, self.sides_b = absent.Sides.of(a, b), absent.Sides.of(b, a)  # seen from a row of A / of B
        # Enough for the largest pair compared whole, and at least the largest tensor's size, so that
        # many cores compare many pairs side by side while memory stays within twice the largest tensor.
        largest = max((e.nbytes or 0 for p in pairs for e in (p.a, p.b) if e is not None), default=0)
        self.buffers = BufferPool(max(largest, *map(self._lease_bytes, pairs), 0))

    def rows(self, workers: int) -> list[Row]:
        """Every pair's row, in order: pairs compared whole and chunks of big ones on one pool."""
        tasks = [(index, pair, span) for index, pair in enumerate(self.pairs) for span in self._chunks(pair)]
        # The pool is the parallelism: torch's own intra-op threads on top of it oversubscribe the
        # cores, and spinning OpenMP threads made a 2-core comparison 8x slower when measured.
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                done = list(pool.map(lambda task: self._task(*task), tasks))
        finally:
            torch.set_num_threads(torch_threads)
        rows: dict[int, Row] = {}
        chunks: dict[int, list[tuple[tuple[int, int], _Chunk]]] = {}
        for (index, pair, span), result in zip(tasks, done):
            if span is None:
                rows[index] = result
            else:
                chunks.setdefault(index, []).append((span, result))
        for index, parts in chunks.items():
            rows[index] = self._merged(self._row(index, self.pairs[index]), self.pairs[index], parts)
        return [rows[index] for index in range(len(self.pairs))]

    def _chunks(self, pair: _Pair) -> list[Optional[tuple[Window, ...]]]:
        """[None] for a pair compared whole; a big pair's windows, CHUNK_WINDOWS a chunk."""
        windows = self._windows(pair)
        if not windows:
            return [None]
        return [tuple(windows[start:start + CHUNK_WINDOWS]) for start in range(0, len(windows), CHUNK_WINDOWS)]

    def _task(self, index: int, pair: _Pair, span: Optional[tuple[Window, ...]]):
        return self.row(index, pair) if span is None else self._chunk(pair, span)

    @staticmethod
    def _row(index: int, pair: _Pair) -> Row:
        layer = pair.a.layer if pair.a else pair.b.layer
        return Row(index=index, kind=pair.kind, name=pair.name, layer=layer)

    def row(self, index: int, pair: _Pair) -> Row:
        """The row of a pair compared whole (or one-sided, or set apart)."""
        row = self._row(index, pair)
        if pair.a is None or pair.b is None:
            entry = pair.a or pair.b
            sides = self.sides_a if pair.b is None else self.sides_b
            why = absent.reason(entry.kind, pair.name, sides)
            row.notes += [why] if why else []
            if absent.op_map(entry.kind, pair.name, sides):
                row.allowed = BY_OP_MAP
            elif self.missable is not None and self.missable.search(pair.name):
                row.allowed = BY_PATTERN
            return _one_side(row, pair)
        apart = pair.a.apart or pair.b.apart
        if apart:
            row.status, row.shape_a, row.shape_b = APART, pair.a.shape, pair.b.shape
            row.notes.append(apart)
            return row
        check_fits(self._lease_bytes(pair), f"comparing {pair.kind} {pair.name}")
        with self.buffers.lease(pair.a.nbytes, pair.b.nbytes) as (buffer_a, buffer_b):
            return self._compare(row, pair, _load(pair.a, buffer_a), _load(pair.b, buffer_b))

    def _lease_bytes(self, pair: _Pair) -> int:
        """What a pair leases: both sides whole, or a window of each, where they are read into buffers."""
        if pair.a is None or pair.b is None or pair.a.apart or pair.b.apart:
            return 0
        windows = self._windows(pair)
        if windows:
            return sum(_window_bytes(entry, windows[0]) for entry in (pair.a, pair.b))
        return (pair.a.nbytes or 0) + (pair.b.nbytes or 0)

    def _windows(self, pair: _Pair) -> list[Window]:
        """The boxes a pair is read in, one after another in the tensor's order, each of about
        WINDOW_BYTES of the larger side, where it is compared a window at a time, else []: big tensors
        whose elements are only compared one by one (no logprobs, routing or reference). Runs of rows of
        dim 0, or, where a row is larger (attention weights [batch, heads, seq, seq], logits [batch,
        seq, vocab]), runs of the first dim whose slices fit, within one index of the dims before it:
        read by rows of dim 0, a tensor of two rows was one window of half of it, leased whole by one
        worker while the others waited for the memory (py-spy: 29% of the workers' time)."""
        a, b = pair.a, pair.b
        if a is None or b is None or a.apart or b.apart or not (a.nbytes and b.nbytes) or \
                max(a.nbytes, b.nbytes) < STREAM_BYTES or a.shape != b.shape or not a.shape or \
                pair.kind in ("logprobs", "routing") or (pair.kind, pair.name) in self.in_reference:
            return []
        shape, itemsize = a.shape, max(a.nbytes, b.nbytes) // math.prod(a.shape)
        dim = next(d for d in range(len(shape)) if math.prod(shape[d + 1:]) * itemsize <= WINDOW_BYTES or
                   d == len(shape) - 1)
        step = max(1, WINDOW_BYTES // (math.prod(shape[dim + 1:]) * itemsize))
        return [(*((i, i + 1) for i in index), (start, min(start + step, shape[dim])))
                for index in itertools.product(*map(range, shape[:dim])) for start in range(0, shape[dim], step)]

    def _chunk(self, pair: _Pair, windows: tuple[Window, ...]) -> "_Chunk":
        """The sums of a run of a big pair's windows, read one at a time into two buffers of a window
        each: the sums of the windows add up to the whole's (metrics.metrics_of), whatever the
        tensor's size. Stops at the first window that cannot be put back together."""
        check_fits(self._lease_bytes(pair), f"comparing {pair.kind} {pair.name}")
        shape = pair.a.shape
        chunk = _Chunk(values=[Value(shape=shape, dtype=entry.dtype) for entry in (pair.a, pair.b)])
        sizes = [_window_bytes(entry, windows[0]) for entry in (pair.a, pair.b)]
        with self.buffers.lease(*sizes) as buffers:
            for window in windows:
                x, y = (entry.load(buffer=buffer, window=window) for entry, buffer in zip((pair.a, pair.b), buffers))
                chunk.add_values(x, y)
                if chunk.problem:
                    break
                chunk.sums.add(pair_sums(x.tensor, y.tensor), _offset(shape, window) - _offset(shape, windows[0]))
        return chunk

    def _merged(self, row: Row, pair: _Pair, chunks: list[tuple[tuple[Window, ...], "_Chunk"]]) -> Row:
        """A big pair's row from its chunks, merged in order up to the first with a problem."""
        whole = _Chunk(values=[Value(shape=pair.a.shape, dtype=entry.dtype) for entry in (pair.a, pair.b)])
        for windows, chunk in chunks:
            whole.add_values(*chunk.values)
            whole.sums.add(chunk.sums, _offset(pair.a.shape, windows[0]))
            if whole.problem:
                break
        return self._compare(row, pair, *whole.values, metrics=metrics_of(whole.sums, pair.a.shape))

    def _compare(self, row: Row, pair: _Pair, x: Value, y: Value,
                 metrics: Optional[TensorMetrics] = None) -> Row:
        """The row's verdict; `metrics`: already computed (a streamed pair, whose Values hold no tensor)."""
        row.shape_a, row.shape_b, row.dtype_a, row.dtype_b = x.shape, y.shape, x.dtype, y.dtype
        problems = [f"{side}: {v.problem}" for side, v in (("A", x), ("B", y)) if v.problem]
        if problems:
            row.status = NOT_REASSEMBLABLE
            row.notes += problems
            return row
        unverifiable = [f"{side}: {v.unverifiable}" for side, v in (("A", x), ("B", y)) if v.unverifiable]
        if unverifiable:
            precision = precision_of(run_precision(self.a.precision, x.dtype), run_precision(self.b.precision, y.dtype))
            threshold = self.thresholds.for_tensor(pair.kind, pair.name, precision, x.shape)
            ruled_out = [f"{side}: {why}" for side, v, other in (("A", x, y), ("B", y, x))
                         if v.parts is not None and (why := _no_reduction_fits(v.parts, other, threshold))]
            row.status = FAIL if ruled_out else UNVERIFIABLE
            row.notes += ruled_out or unverifiable
            return row
        if list(x.shape) != list(y.shape):
            row.status = SHAPE_MISMATCH
            return row
        precision_a, precision_b = run_precision(self.a.precision, x.dtype), run_precision(self.b.precision, y.dtype)
        precision = precision_of(precision_a, precision_b)
        threshold = self.thresholds.for_tensor(pair.kind, pair.name, precision, x.shape)
        replicas_disagree = _judge_replicas(row, x, y, threshold)
        if _is_routing_choice(pair.kind, x, y):
            return _routing_row(row, x, y, replicas_disagree)
        row.dtype_mismatch = x.dtype != y.dtype  # compared in float64 all the same; said once, above the table
        for side, source, value in (("A", self.a, x), ("B", self.b, y)):
            if pair.kind != "input" and _stored_apart(source.precision, value.dtype):  # inputs: exact anyway
                row.notes.append(f"{side}: stored as {value.dtype} by a {source.precision} run; judged at the run's "
                                 "precision")
        row.threshold = threshold
        row.metrics = metrics or _metrics(x, y)
        if pair.kind == "logprobs" and x.tensor is not None and y.tensor is not None:
            row.logprobs = logprob_metrics(x.tensor, y.tensor, self.tokens, self.loss_mask)
        m = row.metrics
        diverged = not (m.rel_diff <= row.threshold)  # NaN compares false: diverged
        if m.nan_a or m.nan_b or m.inf_a or m.inf_b:
            where = "at different positions or signs" if m.nonfinite_mismatch else m.NONFINITE_ALIKE
            row.notes.append(f"NaN/Inf {where}: A {m.nan_a} NaN {m.inf_a} Inf, B {m.nan_b} NaN {m.inf_b} Inf")
        r = self.in_reference.get((pair.kind, pair.name))
        if r is not None and x.tensor is not None and y.tensor is not None:
            truth = r.load()
            if truth.tensor is not None and list(truth.shape) == list(x.shape):
                row.reference = judge(pair.kind, x.shape, tensor_metrics(x.tensor, truth.tensor).rel_diff,
                                      tensor_metrics(y.tensor, truth.tensor).rel_diff, precision_a, precision_b)
                diverged = row.reference.off is not None
                row.threshold = None  # the reference judged this row, not a threshold
        if row.reference is None and not self.thresholds.overrides(pair.name):
            row.scale = check_scale(precision, math.prod(x.shape), m, row.threshold)
        if row.scale is not None and row.scale.off:
            diverged = True
            row.notes.append(row.scale.note())
        strict = self.strict_nonfinite and row.nonfinite_in_both
        row.status = FAIL if diverged or m.nonfinite_mismatch or replicas_disagree or strict else PASS
        return row


@dataclass
class _Chunk:
    """What a run of rows of a big pair adds to its row: the sums, and each side's Value without a
    tensor (its problem, its replicas' gaps)."""

    values: list[Value]
    sums: Sums = field(default_factory=Sums)

    @property
    def problem(self) -> bool:
        return any(value.problem for value in self.values)

    def add_values(self, x: Value, y: Value) -> None:
        for whole, part in zip(self.values, (x, y)):
            whole.problem = part.problem
            whole.add_replicas(part)


def _window_bytes(entry: Entry, window: Window) -> int:
    """The bytes of an entry's tensor inside `window`."""
    return entry.nbytes // math.prod(entry.shape) * math.prod(stop - start for start, stop in window) * \
        math.prod(entry.shape[len(window):])


def _offset(shape: list[int], window: Window) -> int:
    """The position, in the flattened tensor, of a window's first element."""
    return sum(start * math.prod(shape[dim + 1:]) for dim, (start, _) in enumerate(window))


def _load(entry: Entry, buffer: Optional[torch.Tensor]) -> Value:
    return entry.load() if buffer is None else entry.load(buffer=buffer)


def _is_routing_choice(kind: str, x: Value, y: Value) -> bool:
    return kind == "routing" and x.tensor is not None and y.tensor is not None and \
        not x.tensor.is_floating_point() and not y.tensor.is_floating_point()


def _routing_row(row: Row, x: Value, y: Value, replicas_disagree: bool) -> Row:
    """Expert ids are the same or not: the row fails when a token's top-k set changed."""
    m = row.routing = routing_metrics(x.tensor, y.tensor)
    row.notes.append(f"routing: {m.same_set / m.tokens:.2%} of {m.tokens} tokens keep their top-k set, "
                     f"{m.same_order / m.tokens:.2%} its order"
                     + (f"; first flip at token {','.join(map(str, m.first_flip))}" if m.flipped else ""))
    row.status = FAIL if m.flipped or replicas_disagree else PASS
    return row


def _no_reduction_fits(parts: torch.Tensor, other: Value, threshold: float) -> Optional[str]:
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


def _judge_replicas(row: Row, x: Value, y: Value, threshold: float) -> bool:
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
        setattr(row, f"replica_diff_{side.lower()}", rel)
        if rel == math.inf:
            row.notes.append(f"{side}: replicas disagree on where NaN/Inf are ({ranks})")
        elif not rel <= threshold:
            row.notes.append(f"{side}: replicas disagree ({ranks}): rel diff {rel:.3g} over the threshold")
        elif rel:
            row.notes.append(f"{side}: replicas differ within the threshold ({ranks}): rel diff {rel:.3g}")
        disagree = disagree or not rel <= threshold
    return disagree


def _stored_apart(run: Optional[str], stored: str) -> bool:
    """A floating tensor stored narrower than its run computes (bf16 in an fp32 run): worth a note. Wider
    is the rule in bf16 runs (float32 main gradients, loss and logprobs), so it goes unsaid."""
    floating = isinstance(getattr(torch, stored, None), torch.dtype) and getattr(torch, stored).is_floating_point
    return bool(run) and floating and PRECISIONS.index(precision_of(stored)) < PRECISIONS.index(precision_of(run))


def _one_side(row: Row, pair: _Pair) -> Row:
    entry = pair.a or pair.b
    shape, dtype = entry.shape, entry.dtype
    if shape is None:
        value = entry.load()
        shape, dtype = value.shape, value.dtype
    row.status = ONLY_B if pair.a is None else ONLY_A
    row.shape_a, row.dtype_a = (shape, dtype) if pair.a else (None, None)
    row.shape_b, row.dtype_b = (shape, dtype) if pair.b else (None, None)
    return row


def _input(a: Source, b: Source, name: str) -> Optional[torch.Tensor]:
    for source in (a, b):
        for entry in source.entries:
            if entry.kind == "input" and entry.name == name:
                return entry.load().tensor
    return None


def _metrics(x: Value, y: Value) -> Union[TensorMetrics, StatsMetrics]:
    if x.tensor is not None and y.tensor is not None:
        return tensor_metrics(x.tensor, y.tensor)
    return stats_metrics(_stats(x), _stats(y))  # a --stats-only side: compare summaries


def _stats(value: Value) -> TensorStats:
    return value.stats if value.stats is not None else TensorStats.of(value.tensor)


def _summarise(rows: list[Row], first: Optional[int], rescaled: list[KindScale],
               small_scale: list[SmallScale]) -> Summary:
    def count(*statuses: str) -> int:
        return sum(1 for row in rows if row.status in statuses)

    def missing(status: str) -> int:
        return sum(1 for row in rows if row.status == status and row.allowed is None)

    by_kind: dict[str, str] = {}
    for row in rows:
        if row.failing:
            by_kind.setdefault(row.kind, row.name)

    return Summary(compared=count(PASS, FAIL), passed=count(PASS), failed=count(FAIL),
                   shape_mismatch=count(SHAPE_MISMATCH), only_a=count(ONLY_A), only_b=count(ONLY_B),
                   missing_a=missing(ONLY_A), missing_b=missing(ONLY_B),
                   allowed_by_op_map=sum(1 for row in rows if row.allowed == BY_OP_MAP),
                   allowed_by_pattern=sum(1 for row in rows if row.allowed == BY_PATTERN),
                   not_reassemblable=count(NOT_REASSEMBLABLE), skipped=count(SKIPPED), apart=count(APART),
                   unverifiable=count(UNVERIFIABLE),
                   first_divergence=f"{rows[first].kind} {rows[first].name}" if first is not None else None,
                   first_routing_flip=next((f"{row.name} ({row.routing.same_set / row.routing.tokens:.2%} of tokens "
                                            "keep their top-k set)" for row in rows
                                            if row.routing is not None and row.routing.flipped), None),
                   first_failure_by_kind=by_kind,
                   nonfinite_in_both=[f"{row.kind} {row.name}" for row in rows if row.nonfinite_in_both],
                   rescaled=rescaled, small_scale=small_scale)
