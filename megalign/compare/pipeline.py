"""Compare two sources tensor by tensor, stage after stage: the sources opened, the steps they share, their
batches lined up token by token, their tensors matched, each pair read and judged, the kinds judged as a
whole, the report (and a rollout file's findings).

Each stage is a module of its own: sources/ and rollout_pair.py, steps.py, lineup.py, matching.py,
execution.py (reading on a thread pool), judge.py, records.py, rollout_findings.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megalign.compare.entries import Source
from megalign.compare.execution import Execution
from megalign.compare.judge import Rules, judge_kinds
from megalign.compare.kind_choice import KindChoice
from megalign.compare.lineup import line_up
from megalign.compare.objective import on_objective_scale
from megalign.compare.matching import Pair, match_entries
from megalign.compare.rank_rows import unname_after_parameters_differ
from megalign.compare.records import NOT_REASSEMBLABLE, SKIPPED, Allowances, Report, Row, Summary
from megalign.compare.reference import check_reference
from megalign.compare.rollout_findings import RolloutFindings, find
from megalign.compare.rollout_pair import RolloutPair, open_pair
from megalign.compare.sources import open_source
from megalign.compare.sources.sglang_dims_lineup import line_up_dims
from megalign.compare.steps import share_steps
from megalign.compare.thresholds import Thresholds
from megalign.dump.format import Kind
from megalign.errors import UserError, compile_pattern


class NothingCompared(UserError):
    """A comparison that compared no tensor proves nothing: exit 2, with the reason."""


@dataclass
class Compared:
    """What comparing two paths found: the report, the reference as compared (a rollout file's view of it),
    and with a rollout file, the pair and where and why its logprobs differ (None when not compared)."""

    report: Report
    reference: Optional[Source]
    pair: Optional[RolloutPair] = None
    findings: Optional[RolloutFindings] = None


def compare_paths(a: Path, b: Path, reference: Optional[Path], thresholds: Thresholds, needs_rollout: bool = False,
                  **judging) -> Compared:
    """Open A, B and R and compare them (compare_sources, with `judging`'s keywords). A rollout file on
    one side is compared with the dump of its tokens, both laid out alike; `needs_rollout` (a rollout's
    worst sequences asked for) refuses a pair with none, before any dump is read."""
    pair = open_pair(a, b)
    if needs_rollout and pair is None:
        raise UserError("--export-worst writes a rollout file's worst sequences: neither A nor B is a rollout "
                        "file (.json, .jsonl)")
    source_a, source_b = pair.sources() if pair else (open_source(a), open_source(b))
    reference_dump = open_source(reference) if reference else None
    source_r = pair.view(reference_dump) if pair and reference_dump else reference_dump
    report = compare_sources(source_a, source_b, thresholds, reference=source_r, **judging)
    return Compared(report, source_r, pair, find(pair, report, reference_dump) if pair else None)


def compare_sources(a: Source, b: Source, thresholds: Thresholds, name_filter: Optional[str] = None,
                    workers: Optional[int] = None, allow_skipped: Optional[str] = None,
                    reference: Optional[Source] = None, allow_missing: Optional[str] = None,
                    strict_nonfinite: bool = False, kinds: KindChoice = KindChoice()) -> Report:
    """Compare every tensor of the two sources (of the `kinds` chosen); NothingCompared when not one pair
    was compared.
    With `reference` (an fp64 run), the verdict is reference.py's rule instead of the thresholds.
    `strict_nonfinite`: NaN/Inf at the same positions on both sides fail too."""
    a, b, reference = share_steps(a, b, reference)  # a training loop's dumps: the steps all hold
    a, b, reference = line_up(a, b, reference)  # packed and padded batches: compared token by token
    a, b = line_up_dims(a, b)  # sglang dims fused, squeezed or ordered differently: one shape by their names
    a, b, reference = on_objective_scale(a, b, reference)  # activation gradients: by each run's reduction
    pattern, skippable, missable = (compile_pattern(option, value) if value else None for option, value in
                                    (("--filter", name_filter), ("--allow-skipped", allow_skipped),
                                     ("--allow-missing", allow_missing)))
    pairs = _chosen(match_entries(a, b), pattern, name_filter, kinds)
    if reference is not None:
        check_reference(reference, a, b)
    rules = Rules(thresholds, run_a=a.precision, run_b=b.precision, strict_nonfinite=strict_nonfinite,
                  tokens=_input(a, b, "tokens"), loss_mask=_input(a, b, "loss_mask"))
    rows = Execution(a, b, pairs, rules, reference, missable).rows(workers or os.cpu_count() or 1)
    _skip(rows, skippable)
    unname_after_parameters_differ(rows)
    rescaled, small = judge_kinds(rows)
    first = next((row.index for row in rows if row.failing), None)
    report = Report(a=a, b=b, rows=rows, summary=Summary.of(rows, first, rescaled, small), first_divergence=first,
                    allowances=Allowances(allow_skipped, allow_missing, strict_nonfinite))
    _check_something_compared(report)
    return report


def _chosen(matched: list[Pair], pattern: Optional[re.Pattern], name_filter: Optional[str],
            kinds: KindChoice) -> list[Pair]:
    """The pairs --filter (`name_filter`, compiled to `pattern`) names, of the kinds --kind and --skip-kind
    keep: none at all is bad input."""
    pairs = [p for p in matched if (pattern is None or pattern.search(p.name)) and kinds.admits(p.kind)]
    if not matched:
        raise NothingCompared("A and B hold no tensor: nothing compared")
    if not pairs:
        given = ([f"--filter {name_filter!r}"] if name_filter else []) + kinds.given()
        verb = "together match" if len(given) > 1 else "matches"
        raise NothingCompared(f"{' and '.join(given)} {verb} none of the {len(matched)} tensors: nothing compared")
    return pairs


def _input(a: Source, b: Source, name: str) -> Optional[torch.Tensor]:
    for source in (a, b):
        for entry in source.entries:
            if entry.kind == Kind.INPUT and entry.name == name:
                return entry.load().tensor
    return None


def _skip(rows: list[Row], skippable: Optional[re.Pattern]) -> None:
    """--allow-skipped: what it names and could not be put together is skipped, not failed."""
    for row in rows:
        if row.status == NOT_REASSEMBLABLE and skippable is not None and skippable.search(row.name):
            row.status = SKIPPED


def _check_something_compared(report: Report) -> None:
    s = report.summary
    if s.compared or s.shape_mismatch or s.not_reassemblable:
        return  # a shape mismatch or an unreassemblable tensor is a verdict (exit 1), not bad input
    if s.skipped:
        raise NothingCompared(f"every shared tensor ({s.skipped}) is not reassemblable and allowed by "
                              "--allow-skipped: nothing compared")
    raise NothingCompared(f"A and B share no tensor ({s.only_a} only in A, {s.only_b} only in B): nothing compared; "
                          "are they runs of the same model?")
