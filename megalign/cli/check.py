"""`megalign check`: run a baseline and a target (and, with --reference, an fp64 run), then compare.

What users otherwise script by hand:

    megalign check --hf CKPT --baseline "--stack hf" --target "--tp 3"
    megalign check --baseline "--cp 1" --target "--cp 2" --reference

Options check does not know itself go to every run (--hf, --config, --tokens, --seq-len, --seed,
...); --baseline and --target add their own. Each run is a real `megalign forward|backward`
process, so its progress and errors read as they always do.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import typer
from typer.exceptions import TyperException

from megalign.errors import UserError
from megalign.cli.compare import (AllowMissing, AllowSkipped, Filter, Format, JsonOut, Judging, Kinds, NoColor, Plot,
                                  SkipKinds, StrictNonfinite, Threshold, Tolerance, Workers, check_judging,
                                  run_compare)
from megalign.cli.render import console, fail, use_color
from megalign.cli.run import parse_run
from megalign.options import Mode, Output, RunConfig, flag

# Each run's folder and its replacement are check's to decide.
OWN_OPTIONS = (*flag(RunConfig, "out").spelling, *flag(Output, "overwrite").spelling)
RUNS_HELP = ("Run options for {side} only, in one quoted string, e.g. \"--stack hf\" or \"--cp 2 --tp 2\". "
             "Default: none.")


def check(
    ctx: typer.Context,
    baseline: str = typer.Option("", "--baseline", metavar="ARGS", help=RUNS_HELP.format(side="the baseline (A)")),
    target: str = typer.Option("", "--target", metavar="ARGS", help=RUNS_HELP.format(side="the target (B)")),
    reference: bool = typer.Option(False, "--reference",
                                   help="Also run the baseline with --dtype fp64 and judge A and B against it "
                                        "(compare --reference). Default: per-kind thresholds."),
    mode: Mode = typer.Option("backward", "--mode", help="Which pass the runs dump."),
    out: Path = typer.Option(Path("dumps/check"), "--out", "-o", metavar="DIR",
                             help="Folder for the runs' dumps: DIR/baseline, DIR/target, DIR/reference."),
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
    try:
        check_judging(judging, [out])
        argv = {name: _run_argv(mode, ctx.args, option, extra, out / name, overwrite)
                for name, (option, extra) in runs.items()}
    except UserError as e:
        fail(str(e), e.exit_code)
    for name, command in argv.items():
        console.print(f"[bold]{name}[/]: megalign {shlex.join(command[3:])}", highlight=False, soft_wrap=True)
        code = subprocess.run(command).returncode
        if code != 0:
            fail(f"the {name} run failed (exit {code}); nothing compared", 2 if code == 2 else 1)
    raise typer.Exit(run_compare(out / "baseline", out / "target", out / "reference" if reference else None, judging))


def _run_argv(mode: Mode, shared: list[str], option: str, extra: str, out: Path, overwrite: bool) -> list[str]:
    """The command line of one run; `option` (--baseline, --target) is where `extra` came from."""
    try:
        own = shlex.split(extra)
    except ValueError as e:
        raise UserError(f"cannot split {extra!r} into options: {e}") from None
    for own_option in OWN_OPTIONS:
        if own_option in shared or own_option in own:
            raise UserError(f"{own_option} is check's own option: it names each run's folder inside --out")
    _check_run_options(mode, shared, "megalign check")
    _check_run_options(mode, [*shared, *own], f"megalign check {option} {extra!r}")
    return [sys.executable, "-m", "megalign", mode, *shared, *own, "--out", str(out)] + \
        (["--overwrite"] if overwrite else [])


def _check_run_options(mode: Mode, args: list[str], where: str) -> None:
    """Parse a run's options as `megalign MODE` will, so that a typo stops check before any run."""
    try:
        parse_run(mode, args)
    except TyperException as e:  # typer's click: a usage error or a bad value
        raise UserError(f"{where}: {e.format_message()}") from None
