"""The report's records: a row per tensor, the summary, the report, each with its text and JSON forms.

The text forms are what `megalign compare` prints (the table's cells, the summary's lines), the JSON
forms the records of `--json` (report.py writes them, one a line). A summary line is a list of Spans:
text with the rich style it is printed in, each span of text from a dump one of its own, so that the
printer escapes it (cli/render.shown) and the rest stays as written.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

from megalign.compare.entries import Source
from megalign.compare.metrics import LogprobMetrics, RoutingMetrics, StatsMetrics, TensorMetrics
from megalign.compare.rank_rows import is_rank_note
from megalign.compare.reference import ReferenceVerdict
from megalign.compare.scale import KindScale, Scale, SmallScale
from megalign.dump.format import Kind

# Statuses. A tensor on one side only (ONLY_A / ONLY_B) was never compared, so it fails, unless the
# op map between stacks and attention kernels expects it there (absent.py) or the user allowed it
# (--allow-missing): then Verdict.allowed says which, and the summary counts it. One that could not be
# reassembled was never compared either: it fails unless the user allowed it (--allow-skipped), when
# it is SKIPPED and named in the summary. A tensor set APART (lineup.py: positions, not tokens, under
# differently packed batches) is counted. One whose values cannot be verified (Value.unverifiable) is
# UNVERIFIABLE: named apart in the summary, never a divergence, unless no reduction a trainer uses
# could give the other side's value from it (judge.no_reduction_fits): then it FAILs.
PASS, FAIL, SHAPE_MISMATCH = "pass", "fail", "shape_mismatch"
ONLY_A, ONLY_B, NOT_REASSEMBLABLE, SKIPPED, APART = "only_a", "only_b", "not_reassemblable", "skipped", "apart"
UNVERIFIABLE = "unverifiable"
FAILING = (FAIL, SHAPE_MISMATCH, NOT_REASSEMBLABLE)
BY_OP_MAP, BY_PATTERN = "cross-stack op map", "--allow-missing"  # Verdict.allowed of a one-sided row

Span = tuple[str, Optional[str]]  # text, and the rich style it is printed in (None: unstyled)
_KIND_LABEL = {Kind.ACTIVATION: "act", Kind.ACTIVATION_GRAD: "act_grad"}


@dataclass
class Verdict:
    """What the judge (judge.py) decides of one pair: the status, and the figures and notes behind it."""

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
class _Place:
    """Where a row stands in the report: its position in execution order, and the tensor's."""

    index: int
    kind: str
    name: str
    layer: Optional[int]


@dataclass
class Row(Verdict, _Place):
    """A tensor's place and its verdict (the place's fields first: a dataclass takes its bases' fields
    in reverse order of inheritance)."""

    @classmethod
    def of(cls, index: int, kind: str, name: str, layer: Optional[int], verdict: Verdict) -> "Row":
        return cls(index=index, kind=kind, name=name, layer=layer, **vars(verdict))

    def json(self, first_divergence: bool) -> dict:
        """Its --json record (report.py)."""
        record = {"record": "tensor", **dataclasses.asdict(self), "first_divergence": first_divergence}
        record["order"] = record.pop("index")  # position in execution order
        if self.metrics is not None:
            record["metrics"] = {"mode": "stats" if isinstance(self.metrics, StatsMetrics) else "values",
                                 **dataclasses.asdict(self.metrics)}
        return record

    def cells(self, first_divergence: bool) -> list[str]:
        """Its line of the table: #, kind, name, shape, rel diff, max abs diff @ index, thr, status, note."""
        # SHAPE MISMATCH, NOT REASSEMBLABLE: words a narrow terminal's table folds between
        status = self.status.upper().replace("_", " ") + (" ◀ first" if first_divergence else "")
        return [str(self.index), _KIND_LABEL.get(self.kind, self.kind), self.name, self._shape(),
                *self._metric_cells(), "ref" if self.reference else _num(self.threshold), status,
                "; ".join(self._notes())]

    def _shape(self) -> str:
        def text(shape: list[int]) -> str:
            return "x".join(map(str, shape)) if shape else "scalar"

        if self.shape_a is not None and self.shape_b is not None and self.shape_a != self.shape_b:
            return f"{text(self.shape_a)} vs {text(self.shape_b)}"
        return text(self.shape_a if self.shape_a is not None else self.shape_b)

    def _metric_cells(self) -> list[str]:
        m = self.metrics
        if m is None:
            return ["", ""]
        if isinstance(m, TensorMetrics):
            at = f" @{','.join(map(str, m.max_abs_index))}" if m.max_abs_index and m.max_abs_diff > 0 else ""
            return [_num(m.rel_diff), _num(m.max_abs_diff) + at]
        return [_num(m.rel_diff), ""]

    def _notes(self) -> list[str]:
        notes = list(self.notes)
        if self.reference is not None:
            ref = self.reference
            off = f"{ref.off} off: " if ref.off else ""
            notes.append(f"{off}rel to reference A {ref.rel_a:.3g}, B {ref.rel_b:.3g}")
        if self.logprobs is not None:
            lp = self.logprobs
            token = f", token {lp.worst_token}" if lp.worst_token is not None else ""
            notes.append(f"|Δlogprob| max {lp.max_abs_diff:.3g} mean {lp.mean_abs_diff:.3g} p99 {lp.p99_abs_diff:.3g} "
                         f"(seq {lp.worst_sequence} pos {lp.worst_position}{token}); k3 KL {lp.k3_kl:.3g}; "
                         f"p_B/p_A p1 {lp.ratio_p1:.6g} p50 {lp.ratio_p50:.6g} p99 {lp.ratio_p99:.6g}; "
                         f"|Δ|>0.1 {lp.frac_over_0_1:.2%} >1 {lp.frac_over_1:.2%} of {lp.tokens} tokens")
            if lp.outside_max_abs_diff is not None and self.failing:  # on a passing row, noise: in --json only
                token = f", token {lp.outside_token}" if lp.outside_token is not None else ""
                notes.append(f"outside the loss mask |Δlogprob| max {lp.outside_max_abs_diff:.3g} "
                             f"(seq {lp.outside_sequence} pos {lp.outside_position}{token})")
        if isinstance(self.metrics, StatsMetrics) and self.metrics.sketch_k is not None:
            notes.append(f"stats only: sketch estimate ±{self.metrics.rel_diff_std:.2g} "
                         f"(1 std, k={self.metrics.sketch_k})")
        elif self.metrics is not None and not isinstance(self.metrics, TensorMetrics):
            notes.append("stats only: norm/mean/std")
        return notes


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

    @classmethod
    def of(cls, rows: list[Row], first: Optional[int], rescaled: list[KindScale],
           small_scale: list[SmallScale]) -> "Summary":
        def count(*statuses: str) -> int:
            return sum(1 for row in rows if row.status in statuses)

        def missing(status: str) -> int:
            return sum(1 for row in rows if row.status == status and row.allowed is None)

        by_kind: dict[str, str] = {}
        for row in rows:
            if row.failing:
                by_kind.setdefault(row.kind, row.name)

        return cls(compared=count(PASS, FAIL), passed=count(PASS), failed=count(FAIL),
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

    def json(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok}


@dataclass
class Allowances:
    """What the user let through, which the summary's text names."""

    allow_skipped: Optional[str] = None  # --allow-skipped REGEX
    allow_missing: Optional[str] = None  # --allow-missing REGEX
    strict_nonfinite: bool = False


@dataclass
class Report:
    a: Source
    b: Source
    rows: list[Row]
    summary: Summary
    first_divergence: Optional[int]  # index into rows
    allowances: Allowances = field(default_factory=Allowances)

    def json(self) -> list[dict]:
        """Its --json records: a row's each, then the summary's (report.py adds a rollout's findings)."""
        sides = {side: {"path": str(s.path), "format": s.format, "description": s.description}
                 for side, s in (("a", self.a), ("b", self.b))}
        return [row.json(row.index == self.first_divergence) for row in self.rows] + \
            [{"record": "summary", **sides, **self.summary.json()}]

    def dtype_lines(self) -> list[str]:
        """Tensors stored in other dtypes on each side: said once, above the table, not on each row."""
        pairs = collections.Counter((row.dtype_a, row.dtype_b) for row in self.rows if row.dtype_mismatch)
        return [f"dtype A {dtype_a} vs B {dtype_b} ({count} tensor{'' if count == 1 else 's'}), compared in float64"
                for (dtype_a, dtype_b), count in pairs.items()]

    def summary_lines(self) -> list[list[Span]]:
        """The summary under the table: the counts, then what is wrong or unchecked, then the verdict."""
        s, allowed = self.summary, self.allowances
        lines = [_joined(self._counts(), ", ")]
        if s.nonfinite_in_both:
            verdict = "failed (--strict-nonfinite)" if allowed.strict_nonfinite else "not failed"
            lines.append([("NaN/Inf in both:", "bold yellow"), (" ", None), (", ".join(s.nonfinite_in_both), None),
                          (f" ({verdict})", None)])
        for whole in s.rescaled + [pool for pool in s.small_scale if pool.off]:
            lines.append([("rescaled:", "bold red"), (" ", None), (whole.note(), None)])
        for pool in s.small_scale:
            if not pool.off:
                lines.append([("scale unverified:", "yellow"), (" ", None), (pool.note(), None)])
        if s.first_routing_flip:
            lines.append([("routing flip:", "bold red"), (" ", None), (s.first_routing_flip, None),
                          (": the tensors after it see other experts", None)])
        if s.first_divergence:
            lines.append([("first divergence:", "bold red"), (" ", None), (s.first_divergence, None)])
            lines += [[("  ", None), (note, None)] for note in self.rows[self.first_divergence].notes
                      if is_rank_note(note)]
            per_kind = "; ".join(f"{kind} {name}" for kind, name in s.first_failure_by_kind.items())
            lines.append([("first failure per kind: ", None), (per_kind, None)])
        else:
            lines.append([("all compared tensors within threshold", "green")])
        return lines

    def _counts(self) -> list[list[Span]]:
        s, allowed = self.summary, self.allowances
        parts = [[(f"{s.compared} compared", None)], [(f"{s.passed} passed", "green")],
                 [(f"{s.failed} failed", "bold red" if s.failed else "green")]]
        if s.shape_mismatch:
            parts.append([(f"{s.shape_mismatch} shape mismatch", "bold red")])
        if s.missing_a or s.missing_b:
            parts.append([(f"{s.missing_a + s.missing_b} missing", "bold red"),
                          (f" (only in A {s.missing_a}, only in B {s.missing_b})", None)])
        if s.allowed_by_op_map or s.allowed_by_pattern:
            by = ([[(f"{s.allowed_by_op_map} by the cross-stack op map", None)]] if s.allowed_by_op_map else []) + \
                 ([[(f"{s.allowed_by_pattern} by --allow-missing ", None), (repr(allowed.allow_missing), None)]]
                  if s.allowed_by_pattern else [])
            parts.append([(f"{s.allowed_by_op_map + s.allowed_by_pattern} only in one side allowed", "yellow"),
                          (": ", None), *_joined(by, " and ")])
        if s.not_reassemblable:
            parts.append([(f"{s.not_reassemblable} not reassemblable", "bold magenta")])
        if s.skipped:
            parts.append([(f"{s.skipped} skipped", "magenta"), (" (not reassemblable, allowed by --allow-skipped ", None),
                          (repr(allowed.allow_skipped), None), (")", None)])
        if s.unverifiable:
            names = ", ".join(f"{row.kind} {row.name}" for row in self.rows if row.status == UNVERIFIABLE)
            parts.append([(f"{s.unverifiable} unverifiable", "yellow"), (" (", None), (names, None),
                          (": what the values stand for is not recorded; no divergence)", None)])
        if s.apart:
            parts.append([(f"{s.apart} not lined up", "yellow"),
                          (" (positions, attention weights or tokens of unrecorded rows, in differently packed or "
                           "padded batches: see the notes)", None)])
        return parts


def _joined(parts: list[list[Span]], separator: str) -> list[Span]:
    return [span for i, part in enumerate(parts) for span in ([(separator, None)] if i else []) + part]


def _num(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.3g}"
