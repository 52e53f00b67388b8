"""`megalign check`: run a baseline and a target (and, with --reference, an fp64 run), then compare.

What users otherwise script by hand:

    megalign check --hf CKPT --baseline "--stack hf" --target "--tp 3"
    megalign check --baseline "--cp 1" --target "--cp 2" --reference
    megalign check --baseline "--cp 1" --target "--cp 2" --zoom

--zoom finds the first divergence at the cost of statistics (--stats-only runs), then runs again,
the same inputs and seeds, with values for the tensors around it (--dump-only, compare/zoom.py):
full depth where a full dump would not fit on the disk. With --reference the stats-only pass is A
against B alone, at the thresholds, and the zoom runs the reference too and is judged against it (the
zoomed tensors in full values, the rest by their sketches): where A and B agree within the per-kind
thresholds there is no zoom, and no reference.

Options check does not know itself go to every run (--hf, --config, --tokens, --seq-len, --seed,
...); --baseline and --target add their own. Each run is a real `megalign forward|backward`, made
in check's own process as that command makes it, so its progress and errors read as they always do;
the runs share the imports (transformers for --stack hf) and torchrun's launcher server
(run/forked.py): a new process a run paid them again (about 5 s of CPU a run).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer
from typer.exceptions import TyperException

from megalign.compare.metrics import TensorMetrics
from megalign.compare.records import Report
from megalign.compare.zoom import BUDGET, unlined, zoom_around
from megalign.errors import UserError
from megalign.cli.compare import (AllowMissing, AllowSkipped, Filter, Format, JsonOut, Judging, Kinds, NoColor, Plot,
                                  SkipKinds, StrictNonfinite, Threshold, Tolerance, Workers, check_judging, exit_code,
                                  run_compare, speaker)
from megalign.cli.render import console, fail, use_color
from megalign.cli.run import execute, parse_run
from megalign.options import Mode, Output, RunConfig, flag
from megalign.sizes import human_bytes, parse_bytes

# Each run's folder and its replacement are check's to decide.
OWN_OPTIONS = (*flag(RunConfig, "out").spelling, *flag(Output, "overwrite").spelling)
DUMP_ONLY = flag(Output, "dump_only").spelling  # --zoom's, for its second pass
STATS_ONLY = flag(Output, "stats_only").spelling
# --zoom's passes, each a folder of --out holding its runs' folders.
STATS_PASS, ZOOM_PASS = "stats-only", "zoomed"
RUNS_HELP = ("Run options for {side} only, in one quoted string, e.g. \"--stack hf\" or \"--cp 2 --tp 2\". "
             "Default: none.")


def check(
    ctx: typer.Context,
    baseline: str = typer.Option("", "--baseline", metavar="ARGS", help=RUNS_HELP.format(side="the baseline (A)")),
    target: str = typer.Option("", "--target", metavar="ARGS", help=RUNS_HELP.format(side="the target (B)")),
    reference: bool = typer.Option(False, "--reference",
                                   help="Also run the baseline with --dtype fp64 and judge A and B against it "
                                        "(compare --reference). Default: per-kind thresholds."),
    zoom: bool = typer.Option(False, "--zoom",
                              help="Two passes, for runs whose full dump would not fit the disk: every run "
                                   "--stats-only, compared; where they diverge, every run again (same inputs and "
                                   "seeds) with values only for the tensors around the first divergence (its "
                                   "neighbours in computation order, their gradients, its parameters' gradients: "
                                   "--dump-only) and statistics for the rest, and that comparison is the verdict. "
                                   "Agreeing statistics: exit 0 with no second pass. With --reference the "
                                   "stats-only pass is A against B, and the second pass runs and judges against "
                                   "the reference too. Default: one pass, all values."),
    zoom_budget: Optional[str] = typer.Option(None, "--zoom-budget", metavar="SIZE",
                                              help="--zoom's full values a run may write, its ranks together (2GiB, "
                                                   "500MB, 1e9 bytes): the first divergence is always zoomed, the "
                                                   "tensors around it nearest first while they fit, the rest stay "
                                                   "stats-only and are named. Default: "
                                                   f"{human_bytes(BUDGET).replace(' ', '')}."),
    mode: Mode = typer.Option("backward", "--mode", help="Which pass the runs dump."),
    out: Path = typer.Option(Path("dumps/check"), "--out", "-o", metavar="DIR",
                             help="Folder for the runs' dumps: DIR/baseline, DIR/target, DIR/reference (with "
                                  f"--zoom: in DIR/{STATS_PASS} and DIR/{ZOOM_PASS})."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace the dumps of an earlier check in --out (only megalign dumps are "
                                        "ever replaced). Default: refuse existing dumps."),
    filter: Filter = None,
    kind: Kinds = None,
    skip_kind: SkipKinds = None,
    threshold: Threshold = None,
    tolerance: Tolerance = [],
    allow_skipped: AllowSkipped = None,
    allow_missing: AllowMissing = None,
    # Strict here: a run of check's own making with NaN/Inf on both sides is a broken run, not agreement.
    strict_nonfinite: StrictNonfinite = True,
    json_out: JsonOut = None,
    plot: Plot = None,
    workers: Workers = None,
    fmt: Format = "auto",
    no_color: NoColor = False,
) -> None:
    """Run a baseline and a target (any options of forward/backward) and compare them: exit 0 when they agree, 1 when
    they diverge or a run crashed, 2 for bad input."""
    use_color(no_color)
    judging = Judging(filter=filter, kind=kind, skip_kind=skip_kind, threshold=threshold, tolerance=tolerance, allow_skipped=allow_skipped,
                      allow_missing=allow_missing, strict_nonfinite=strict_nonfinite, json_out=json_out, plot=plot,
                      workers=workers, fmt=fmt)
    runs = {"baseline": ("--baseline", baseline), "target": ("--target", target)}
    if reference:
        runs["reference"] = ("--baseline", f"{baseline} --dtype fp64")
    first = out / STATS_PASS if zoom else out
    # Statistics have no values to hold against the reference's rounding: the stats-only pass judges A
    # against B alone, and a zoom runs the reference with them.
    stats_runs = [name for name in runs if name != "reference"] if zoom else list(runs)

    def commands(folder: Path, added: tuple[str, ...], names: list[str]) -> dict[str, list[str]]:
        return {name: _run_argv(mode, ctx.args, *runs[name], folder / name, overwrite, added, zoom) for name in names}

    try:
        if zoom_budget is not None and not zoom:
            raise UserError("--zoom-budget is --zoom's: add --zoom, or leave it out")
        budget = BUDGET if zoom_budget is None else parse_bytes(zoom_budget, "--zoom-budget")
        check_judging(judging, [out])
        argv = commands(first, (STATS_ONLY[0],) if zoom else (), stats_runs)
        if zoom:  # the zoom's reference run checked too, before any run starts
            commands(out / ZOOM_PASS, (), list(runs))
    except UserError as e:
        fail(str(e), e.exit_code)
    _launch(argv)
    compared = run_compare(*_dumps(first, reference and not zoom), judging, table=not zoom)
    if zoom and (apart := unlined(compared.rows)):
        fail(f"--zoom: the runs lay out their rows differently (packed against padded, or padded to other lengths), "
             f"and statistics cannot line up their {apart} token tensors; check without --zoom", 2)
    say = speaker(fmt)
    if not zoom or compared.summary.ok:
        if zoom:
            say("the stats-only pass agrees: nothing to zoom into, no second pass")
        raise typer.Exit(exit_code(compared))
    around = zoom_around(compared, budget, itemsize=8 if reference else 0)
    say(f"\n[bold]zoom[/]: every run again, with values for {len(around.names)} tensors around the first divergence "
        f"({human_bytes(around.nbytes)} a run)" + (f", {len(around.left_out)} more past the budget"
                                                   if around.left_out else ""))
    _launch(commands(out / ZOOM_PASS, (DUMP_ONLY[0], str(around.rule)), list(runs)))
    zoomed = run_compare(*_dumps(out / ZOOM_PASS, reference), judging)
    say(around.line())
    if zoomed.first_divergence is not None:
        say(_in_full(zoomed))
    raise typer.Exit(exit_code(zoomed))


def _launch(argv: dict[str, list[str]]) -> None:
    """Each run in turn; a failed one stops check with its exit code (2 for bad input, 130 interrupted, else 1)."""
    for name, command in argv.items():
        console.print(f"[bold]{name}[/]: megalign {shlex.join(command)}", highlight=False, soft_wrap=True)
        code = _exit_code(command)
        if code != 0:
            fail(f"the {name} run failed (exit {code}); nothing compared", code if code in (2, 130) else 1)


def _exit_code(args: list[str]) -> int:
    """`megalign ARGS` (a run's), made here: its exit code."""
    try:
        execute(parse_run(args[0], args[1:]))
    except typer.Exit as e:
        return e.exit_code
    return 0


def _dumps(folder: Path, reference: bool) -> tuple[Path, Path, Optional[Path]]:
    return folder / "baseline", folder / "target", folder / "reference" if reference else None


def _in_full(report: Report) -> str:
    """The zoomed comparison's first divergence, with its full metrics where it lies in the zoom."""
    row = report.rows[report.first_divergence]
    rel, max_abs, threshold = row.cells(True)[4:7]
    figures = [f"rel diff {rel}" if rel else "", f"max abs diff {max_abs}" if max_abs else ""]
    if row.reference is not None:  # judged against the fp64 run, not a threshold
        ref = row.reference
        figures.append(f"{ref.off} off against the reference (rel to it A {ref.rel_a:.3g}, B {ref.rel_b:.3g})")
    elif threshold:
        figures.append(f"threshold {threshold}")
    said = ", ".join(figure for figure in figures if figure)
    if isinstance(row.metrics, TensorMetrics):
        return f"first divergence, in full values: {row.kind} {row.name}: {said}"
    outside = f"first divergence, outside the zoom (statistics only): {row.kind} {row.name}"
    return outside + (f": {said}" if said else "")


def _run_argv(mode: Mode, shared: list[str], option: str, extra: str, out: Path, overwrite: bool,
              added: tuple[str, ...] = (), zoom: bool = False) -> list[str]:
    """The command line of one run, with check's `added` options; `option` (--baseline, --target) is
    where `extra` came from."""
    try:
        own = shlex.split(extra)
    except ValueError as e:
        raise UserError(f"cannot split {extra!r} into options: {e}") from None
    for own_option in OWN_OPTIONS:
        if own_option in shared or own_option in own:
            raise UserError(f"{own_option} is check's own option: it names each run's folder inside --out")
    for own_option in DUMP_ONLY if zoom else ():
        if own_option in shared or own_option in own:
            raise UserError(f"{own_option} is --zoom's own option: its second pass chooses the tensors")
    _check_run_options(mode, shared, "megalign check")
    _check_run_options(mode, [*shared, *own], f"megalign check {option} {extra!r}")
    return [mode, *shared, *own, *added, "--out", str(out)] + \
        (["--overwrite"] if overwrite else [])


def _check_run_options(mode: Mode, args: list[str], where: str) -> None:
    """Parse a run's options as `megalign MODE` will, so that a typo stops check before any run."""
    try:
        parse_run(mode, args)
    except TyperException as e:  # typer's click: a usage error or a bad value
        raise UserError(f"{where}: {e.format_message()}") from None
