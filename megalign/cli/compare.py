"""`megalign compare A B`: where two dumps stop agreeing, tensor by tensor."""

from __future__ import annotations

import functools
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional

import typer

from megalign.compare.explain import explain
from megalign.compare.kind_choice import KindChoice
from megalign.compare.outputs import Output, check_outputs, write_replacing
from megalign.compare.report import is_report, write_jsonl
from megalign.compare.rollout_findings import is_worst_file, write_worst
from megalign.compare.thresholds import Thresholds
from megalign.compare.zoom import stats_divergence, zoom_around
from megalign.compare.pipeline import compare_paths
from megalign.compare.records import (APART, FAIL, NOT_REASSEMBLABLE, ONLY_A, ONLY_B, PASS, SHAPE_MISMATCH, SKIPPED,
                                      UNVERIFIABLE, Report, Row, Span)
from megalign.dump.format import KINDS
from megalign.errors import UserError
from megalign.cli.rollout import print_rollout
from megalign.stacks import STACKS
from megalign.cli.render import (DROP, FOLD, Cell, Column, console, fail, print_table, reader_may_leave,
                                 resolve_format, shown, use_color)

_STATUS_STYLE = {PASS: "green", FAIL: "bold red", SHAPE_MISMATCH: "bold red", ONLY_A: "yellow", ONLY_B: "yellow",
                 NOT_REASSEMBLABLE: "bold magenta", SKIPPED: "magenta", APART: "yellow",
                 UNVERIFIABLE: "yellow"}


# The options that judge and print a comparison, shared by `compare` and `check`.
Filter = Annotated[Optional[str], typer.Option(
    "--filter", metavar="REGEX", help="Only compare tensors whose name matches REGEX (re.search). A filter that "
                                      "matches nothing is an error (exit 2). Default: all.")]
Kinds = Annotated[Optional[str], typer.Option(
    "--kind", metavar="KIND[,KIND...]", help=f"Only compare tensors of these kinds ({', '.join(KINDS)}); with --filter, "
                                             "tensors both select. An unknown kind is an error (exit 2). Default: all.")]
SkipKinds = Annotated[Optional[str], typer.Option(
    "--skip-kind", metavar="KIND[,KIND...]", help="Leave out tensors of these kinds (e.g. activation_grad), also from "
                                                  "what --kind keeps. Default: none.")]
Threshold = Annotated[Optional[float], typer.Option(
    "--threshold", metavar="X", help="Relative-difference threshold for every tensor, overriding the per-kind "
                                     "defaults (finite, >= 0). Default: per kind and precision.")]
Tolerance = Annotated[list[str], typer.Option(
    "--tolerance", metavar="REGEX=X", help="Threshold X for tensors whose name matches REGEX; repeatable, the last "
                                           "match wins, beats --threshold. Default: none.")]
AllowSkipped = Annotated[Optional[str], typer.Option(
    "--allow-skipped", metavar="REGEX", help="Tensors matching REGEX that cannot be reassembled are skipped (and "
                                             "named in the summary) instead of failing. Default: none.")]
AllowMissing = Annotated[Optional[str], typer.Option(
    "--allow-missing", metavar="REGEX", help="Tensors matching REGEX that only one side holds are listed (and counted "
                                             "in the summary) instead of failing. Default: only those the op map "
                                             "between stacks and attention kernels expects on one side.")]
StrictNonfinite = Annotated[bool, typer.Option(
    "--strict-nonfinite/--no-strict-nonfinite",
    help="Fail tensors with NaN/Inf on both sides, even at the same positions. Default: a warning in the summary "
         "(check: strict).")]
JsonOut = Annotated[Optional[Path], typer.Option(
    "--json", metavar="FILE", help="Also write the report as JSON lines to FILE: a new file, or an earlier "
                                   "report, which it replaces (never another file). Default: none.")]
Plot = Annotated[Optional[Path], typer.Option(
    "--plot", metavar="FILE", help="Also draw the relative difference per layer to FILE (.png, .svg or .pdf). "
                                   "Default: none.")]
Workers = Annotated[Optional[int], typer.Option(
    "--workers", metavar="N", min=1, help="Tensors compared in parallel. Default: the CPU count.")]
Format = Annotated[Literal["auto", "table", "plain", "markdown"], typer.Option(
    "--format", help="How the table is printed: table (rich, for a terminal), plain (aligned text, full names), "
                     "markdown (a CI comment). auto: table in a colour terminal, else plain.")]
NoColor = Annotated[bool, typer.Option("--no-color", help="No colours (also NO_COLOR=1); auto format is then plain. "
                                                          "Default: colours in a terminal.")]


@dataclass
class Judging:
    """What `compare` and `check` were told about judging and printing."""

    filter: Optional[str] = None
    kind: Optional[str] = None
    skip_kind: Optional[str] = None
    threshold: Optional[float] = None
    tolerance: list[str] = field(default_factory=list)
    allow_skipped: Optional[str] = None
    allow_missing: Optional[str] = None
    strict_nonfinite: bool = False
    json_out: Optional[Path] = None
    plot: Optional[Path] = None
    workers: Optional[int] = None
    fmt: str = "auto"
    export_worst: Optional[tuple[int, Path]] = None  # compare with a rollout file: N, FILE


def compare(
    a: Path = typer.Argument(..., metavar="A", show_default=False,
                             help="First dump: a megalign dump, an sglang dumper folder, or .safetensors/.pt tensors; "
                                  "or an engine's rollout file (.json, .jsonl) against a megalign forward --rollout "
                                  "dump of it (either order)."),
    b: Optional[Path] = typer.Argument(None, metavar="B", show_default=False,
                                       help="Second dump, of any of the same kinds (only --explain may leave it out)."),
    filter: Filter = None,
    kind: Kinds = None,
    skip_kind: SkipKinds = None,
    threshold: Threshold = None,
    tolerance: Tolerance = [],
    reference: Optional[Path] = typer.Option(None, "--reference", metavar="R",
                                             help="An fp64 run of the same model and tokens (megalign forward|"
                                                  "backward --dtype fp64, any layout or stack). Each side's distance "
                                                  "to R is its own rounding error; a tensor fails when a side's error "
                                                  "exceeds its precision's rounding budget, and the row says which "
                                                  "side (A, B or both). Default: per-kind thresholds on A vs B."),
    allow_skipped: AllowSkipped = None,
    allow_missing: AllowMissing = None,
    strict_nonfinite: StrictNonfinite = False,
    json_out: JsonOut = None,
    plot: Plot = None,
    workers: Workers = None,
    fmt: Format = "auto",
    no_color: NoColor = False,
    export_worst: Optional[tuple[int, Path]] = typer.Option(
        None, "--export-worst", metavar="N FILE",
        help="With a rollout file: also write its N worst sequences (by k3 KL and by max |Δlogprob|) as a tokens "
             "file that megalign forward --tokens FILE runs, for a repro: a new file, or an earlier --export-worst "
             "file, which it replaces. Default: none."),
    explain: Optional[str] = typer.Option(
        None, "--explain", metavar="NAME",
        help="Compare nothing: print how the tensor NAME is put back together in each input (A, B if given, R), "
             "rank by rank: which piece of the whole each rank holds, where it goes along which dim, which ranks "
             "hold replicas (and whether they are read, by hash); exit 0. A NAME no input holds is exit 2, with "
             "the nearest names. Default: none."),
) -> None:
    """Compare two dumps tensor by tensor; exit 0 when all agree within threshold, 1 when any diverges or is missing
    on one side, 2 for bad input. With --explain NAME, print how NAME is reassembled in each input instead."""
    use_color(no_color)
    inputs = [(side, path) for side, path in (("A", a), ("B", b), ("R", reference)) if path is not None]
    if explain is not None:
        raise typer.Exit(run_explain(inputs, explain))
    if b is None:
        fail("compare needs two inputs, A and B (only --explain NAME reads one)", 2)
    judging = Judging(filter=filter, kind=kind, skip_kind=skip_kind, threshold=threshold, tolerance=tolerance, allow_skipped=allow_skipped,
                      allow_missing=allow_missing, strict_nonfinite=strict_nonfinite, json_out=json_out, plot=plot,
                      workers=workers, fmt=fmt, export_worst=export_worst)
    raise typer.Exit(exit_code(run_compare(a, b, reference, judging)))


def check_judging(judging: Judging, inputs: list[Path]) -> tuple[Thresholds, KindChoice]:
    """The bad input a comparison can be refused for before anything is read or run."""
    kinds = KindChoice(judging.kind, judging.skip_kind)
    worst_n, worst_file = judging.export_worst or (None, None)
    if worst_n is not None and worst_n < 1:
        raise UserError(f"--export-worst {worst_n}: N must be at least 1")
    check_outputs([Output("--json", judging.json_out, is_report, "report"), Output("--plot", judging.plot),
                   Output("--export-worst", worst_file, is_worst_file, "worst-sequences file")], inputs)
    return Thresholds.from_cli(judging.threshold, judging.tolerance), kinds


def exit_code(report: Report) -> int:
    return 0 if report.summary.ok else 1


def speaker(fmt: str) -> Callable[..., None]:
    """How the lines around a table print: in a terminal (fmt "table") they wrap between words, at its
    width; elsewhere each stays one line, whole, for grep and for a reader of any width."""
    return functools.partial(console.print, highlight=False, soft_wrap=resolve_format(fmt) != "table")


def run_compare(a: Path, b: Path, reference: Optional[Path], judging: Judging, table: bool = True) -> Report:
    """Compare, print the table (unless not `table`: check --zoom's stats-only pass, which zooms itself)
    and summary, write the reports; exit 2 after a one-line error."""
    try:
        thresholds, kinds = check_judging(judging, [a, b] + ([reference] if reference else []))
        compared = compare_paths(a, b, reference, thresholds, needs_rollout=judging.export_worst is not None,
                                 name_filter=judging.filter, workers=judging.workers,
                                 allow_skipped=judging.allow_skipped, allow_missing=judging.allow_missing,
                                 strict_nonfinite=judging.strict_nonfinite, kinds=kinds)
    except UserError as e:
        fail(str(e), e.exit_code)
    report, findings = compared.report, compared.findings
    fmt = resolve_format(judging.fmt)
    say = speaker(fmt)
    with reader_may_leave():
        for side, path, source in (("A", a, report.a), ("B", b, report.b), ("R", reference, compared.reference)):
            if source is not None:
                say(f"[bold]{side}[/] {shown(str(path))}: {shown(source.description)}"
                    + (" (the reference)" if side == "R" else ""))
        for line in report.dtype_lines():
            say(line)
        console.print()
        if table:
            print_table(COLUMNS, [_cells(row, row.index == report.first_divergence) for row in report.rows],
                        fmt, highlight=report.first_divergence, narrowing=NARROWING)
            console.print()
        for line in report.summary_lines():
            say(_markup(line))
        if table and stats_divergence(report) is not None:
            say(_zoom_hint(report))
        if findings:
            print_rollout(findings, judging.fmt)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    if judging.json_out is not None:
        _write_report(judging.json_out, lambda tmp: write_jsonl(report, tmp, findings))
    if judging.plot is not None:
        from megalign.compare.plot import plot_divergence

        _write_report(judging.plot, lambda tmp: plot_divergence(report, tmp))
    if judging.export_worst is not None and findings is not None:
        n, path = judging.export_worst
        _write_report(path, lambda tmp: write_worst(tmp, compared.pair, findings, n))
    return report


def _zoom_hint(report: Report) -> str:
    """How to see a divergence judged on statistics in full: both sides again, zoomed alike."""
    zoom = zoom_around(report)
    rule = shlex.quote(str(zoom.rule))
    if report.a.stack in STACKS:
        return (f"zoom in: megalign check --zoom, or both runs again with --dump-only {rule}, and compare the "
                f"two{zoom.past_budget()}")
    return (f"zoom in: both loops again, the same inputs and seeds, with MEGALIGN_DUMP_ONLY={rule} (Dumper's "
            f"dump_only=), and compare the two{zoom.past_budget()}")


def run_explain(inputs: list[tuple[str, Path]], name: str) -> int:
    """Print the plan of tensor `name` in every input; 0, or 2 after a one-line error."""
    try:
        lines = explain(inputs, name)
    except UserError as e:
        fail(str(e), e.exit_code)
    with reader_may_leave():
        for line in lines:
            console.print(shown(line), highlight=False, soft_wrap=True)
        sys.stdout.flush()
    return 0


def _write_report(path: Path, write) -> None:
    try:
        write_replacing(path, write)
    except OSError as e:  # the error of a failed write or flush names no file: the user's path does
        fail(f"cannot write {path}: {e.strerror}", 2)


# Mean abs diff, cosine and the rest are in the --json report.
COLUMNS = (Column("#", right=True), Column("kind"), Column("name", wraps=True), Column("shape"),
           Column("rel diff", right=True), Column("max abs diff @ index", right=True), Column("thr", right=True),
           Column("status"), Column("note", wraps=True, footnote=True))
# In a terminal too narrow for the table, the least useful give way first: the note folds, then goes
# under the table; the threshold goes (the kind's default, docs/compare.md); long names fold to 40 characters
# (a few rows on two lines, before every row's index is); the index, the status and the shape fold;
# last the names fold further.
NARROWING = (("note", FOLD), ("note", DROP), ("thr", DROP), ("name", 40), ("max abs diff @ index", FOLD),
             ("status", FOLD), ("shape", FOLD), ("name", FOLD))

def _cells(row: Row, first: bool) -> list[Cell]:
    """Row.cells, the status in its colour."""
    texts = row.cells(first)
    return [Cell(text, _STATUS_STYLE[row.status] if column.header == "status" else None)
            for column, text in zip(COLUMNS, texts)]


def _markup(line: list[Span]) -> str:
    """A line of spans as rich markup, the text of each shown as written."""
    return "".join(f"[{style}]{shown(text)}[/]" if style else shown(text) for text, style in line)
