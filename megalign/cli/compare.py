"""`megalign compare A B`: where two dumps stop agreeing, tensor by tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from megalign.alignment.compare import (FAIL, NOT_REASSEMBLABLE, ONLY_A, ONLY_B, PASS, SHAPE_MISMATCH, Report, Row,
                                        compare_sources)
from megalign.alignment.errors import UserError
from megalign.alignment.metrics import TensorMetrics
from megalign.alignment.sources import open_source
from megalign.alignment.thresholds import Thresholds
from megalign.cli.render import console, fail

_STATUS_STYLE = {PASS: "green", FAIL: "bold red", SHAPE_MISMATCH: "bold red", ONLY_A: "yellow", ONLY_B: "yellow",
                 NOT_REASSEMBLABLE: "magenta"}


def compare(
    a: Path = typer.Argument(..., help="First dump: a megalign dump, an sglang dumper folder, or .safetensors/.pt tensors."),
    b: Path = typer.Argument(..., help="Second dump, of any of the same kinds."),
    filter: Optional[str] = typer.Option(None, "--filter", help="Only compare tensors whose name matches this regex (re.search)."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="Relative-difference threshold for every tensor, "
                                              "overriding the per-kind defaults."),
    tolerance: list[str] = typer.Option([], "--tolerance", help="REGEX=VALUE: threshold for tensors whose name matches "
                                        "REGEX; repeatable, the last match wins, beats --threshold."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON lines to this file."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of the relative difference per layer."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Tensors compared in parallel (default: the CPU count)."),
) -> None:
    """Compare two dumps tensor by tensor; exit 0 when all agree within threshold, 1 when any diverges, 2 for bad input."""
    try:
        thresholds = Thresholds.from_cli(threshold, tolerance)
        source_a, source_b = open_source(a), open_source(b)
        report = compare_sources(source_a, source_b, thresholds, name_filter=filter, workers=workers)
    except UserError as e:
        fail(str(e), e.exit_code)
    console.print(f"[bold]A[/] {escape(str(a))}: {escape(source_a.description)}", highlight=False, soft_wrap=True)
    console.print(f"[bold]B[/] {escape(str(b))}: {escape(source_b.description)}", highlight=False, soft_wrap=True)
    # A pipe or file has no width of its own: rich would assume 80 columns and fold every name.
    (console if console.is_terminal else Console(width=_FILE_WIDTH)).print(_table(report))
    _print_summary(report)
    try:
        if json_out is not None:
            from megalign.alignment.report import write_jsonl

            write_jsonl(report, json_out)
        if plot is not None:
            from megalign.alignment.plot import plot_divergence

            plot_divergence(report, plot)
    except OSError as e:
        fail(f"cannot write {e.filename}: {e.strerror}", 2)
    raise typer.Exit(0 if report.summary.ok else 1)


_FILE_WIDTH = 160
_KIND_LABEL = {"activation": "act", "activation_grad": "act_grad"}


def _table(report: Report) -> Table:
    """One row per tensor; mean abs diff, cosine and the rest are in the --json report."""
    table = Table(header_style="bold", pad_edge=False, box=box.SIMPLE_HEAD)
    for header, justify in (("#", "right"), ("kind", "left"), ("name", "left"), ("shape", "left"),
                            ("rel diff", "right"), ("max abs diff @ index", "right"), ("thr", "right"),
                            ("status", "left"), ("note", "left")):
        # Names and notes fold onto more lines; the short columns keep one line each.
        wraps = header in ("name", "note")
        table.add_column(header, justify=justify, overflow="fold", no_wrap=not wraps,
                         min_width=24 if header == "name" else None,
                         ratio=3 if header == "name" else 1 if header == "note" else None)
    for row in report.rows:
        first = row.index == report.first_divergence
        status = f"[{_STATUS_STYLE[row.status]}]{row.status.upper()}[/]" + (" ◀ first" if first else "")
        table.add_row(str(row.index), _KIND_LABEL.get(row.kind, row.kind), escape(row.name), _shape(row),
                      *_metric_cells(row), _num(row.threshold), status, escape("; ".join(_notes(row))),
                      style="on grey23" if first else None)
    return table


def _shape(row: Row) -> str:
    def text(shape: list[int]) -> str:
        return "x".join(map(str, shape)) if shape else "scalar"

    if row.shape_a is not None and row.shape_b is not None and row.shape_a != row.shape_b:
        return f"{text(row.shape_a)} vs {text(row.shape_b)}"
    return text(row.shape_a if row.shape_a is not None else row.shape_b)


def _metric_cells(row: Row) -> list[str]:
    m = row.metrics
    if m is None:
        return ["", ""]
    if isinstance(m, TensorMetrics):
        at = f" @{','.join(map(str, m.max_abs_index))}" if m.max_abs_index and m.max_abs_diff > 0 else ""
        return [_num(m.rel_diff), _num(m.max_abs_diff) + at]
    return [_num(m.rel_diff), ""]


def _notes(row: Row) -> list[str]:
    notes = list(row.notes)
    if row.logprobs is not None:
        lp = row.logprobs
        token = f", token {lp.worst_token}" if lp.worst_token is not None else ""
        notes.append(f"logprob |diff| max {lp.max_abs_diff:.3g} mean {lp.mean_abs_diff:.3g} p99 {lp.p99_abs_diff:.3g} "
                     f"at seq {lp.worst_sequence} pos {lp.worst_position}{token}")
    if row.metrics is not None and not isinstance(row.metrics, TensorMetrics):
        notes.append("stats only: norm/mean/std")
    return notes


def _num(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.3g}"


def _print_summary(report: Report) -> None:
    s = report.summary
    parts = [f"{s.compared} compared", f"[green]{s.passed} passed[/]",
             f"[{'bold red' if s.failed else 'green'}]{s.failed} failed[/]"]
    if s.shape_mismatch:
        parts.append(f"[bold red]{s.shape_mismatch} shape mismatch[/]")
    parts.append(f"[yellow]{s.only_a + s.only_b} only in one side[/] (A {s.only_a}, B {s.only_b})")
    if s.not_reassemblable:
        parts.append(f"[magenta]{s.not_reassemblable} not reassemblable[/]")
    console.print(", ".join(parts), highlight=False, soft_wrap=True)
    if s.first_divergence:
        console.print(f"[bold red]first divergence:[/] {escape(s.first_divergence)}", highlight=False, soft_wrap=True)
        per_kind = "; ".join(f"{kind} {name}" for kind, name in s.first_failure_by_kind.items())
        console.print(f"first failure per kind: {escape(per_kind)}", highlight=False, soft_wrap=True)
    else:
        console.print("[green]all compared tensors within threshold[/]", highlight=False, soft_wrap=True)
