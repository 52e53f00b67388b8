"""`megalign forward` and `megalign backward`: one command factory, its options built from options.RunConfig."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
from dataclasses import replace
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from megalign.errors import RunFailed, UserError
from megalign.options import FLAG, Mode, RunConfig, option_fields
from megalign.run.launch import (RunResult, check_options, launch, run_here, run_in_process,
                                           signals_as_interrupts)
from megalign.run.plan import plan_run
from megalign.run.replay import REPLAY_FILE, routing_replay
from megalign.stacks.dist_checkpoint import MODEL_FILE
from megalign.cli.render import console, err_console, fail, plural, shown
from megalign.sizes import human_bytes


def run_command(mode: Mode):
    """The Typer command function of `mode` ("forward" or "backward"): one option per field of RunConfig."""

    def command(**values) -> None:
        execute(RunConfig.from_options(mode, values))

    command.__signature__ = inspect.Signature([_typer_parameter(f, hint, mode) for f, hint in option_fields()])
    command.__doc__ = (
        "Run the model forward and dump activations, logits and logprobs." if mode == "forward" else
        "Run forward and backward and dump activations, activation gradients, parameter gradients, logits, "
        "logprobs and the loss.")
    return command


def parse_run(mode: Mode, args: list[str]) -> RunConfig:
    """`args` read as `megalign MODE ARGS` reads them, every default filled in; click's usage errors raise
    (typer.exceptions.TyperException)."""
    # The command alone, as a one-command Typer makes it: the same options as `megalign MODE`'s, and
    # cli/app.py (which imports this module) is not needed to read them.
    alone = typer.Typer()
    alone.command(mode)(run_command(mode))
    context = typer.main.get_command(alone).make_context(mode, list(args))
    return RunConfig.from_options(mode, context.params)


def _typer_parameter(option: dataclasses.Field, hint, mode: Mode) -> inspect.Parameter:
    flag = option.metadata[FLAG]
    typer_option = typer.Option(option.default, *flag.spelling, metavar=flag.metavar, help=flag.help,
                                show_default=flag.show_default, hidden=flag.backward_only and mode == "forward")
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=typer_option, annotation=hint)


def execute(config: RunConfig) -> None:
    """One run, as `megalign forward|backward` makes it: its progress and summary printed; where it
    fails, its error line and typer.Exit with the exit code (2 for bad input, 1 for a failed run, 130
    when interrupted)."""
    stack, overwrite = config.source.stack, config.output.overwrite
    replay_dir = None
    try:
        spec = plan_run(config)
        replay_dir = routing_replay(spec, stack, config.parallel.routing)
        spec = replace(spec, routing_replay=str(replay_dir / REPLAY_FILE)) if replay_dir else spec
        with signals_as_interrupts():
            if stack == "hf":
                result = _run_hf(spec, stack, config.launch.launcher, overwrite)
            elif config.launch.launcher == "none":
                result = _run_here(spec, stack)
            else:
                check_options(spec, config.launch)
                result = _with_progress(spec, spec.layout.world_size // config.launch.nnodes,
                                        lambda on_event: launch(spec, stack, config.launch, overwrite, on_event))
    except UserError as e:
        fail(str(e), 2)
    except RunFailed as e:
        if e.details:
            err_console.print(e.details, style="dim", markup=False, highlight=False, soft_wrap=True)
        fail(str(e), 1)
    except KeyboardInterrupt as e:
        fail(f"interrupted ({e.args[0] if e.args else 'SIGINT'}): every worker stopped, nothing written", 130)
    finally:
        if replay_dir is not None:
            shutil.rmtree(replay_dir, ignore_errors=True)
    if result is not None:
        _summary(spec, result, stack)


def _with_progress(spec, ranks: int, run) -> RunResult:
    """Bars for the ranks started, through the pass and done writing; `run(on_event)` does the work."""
    phase = "backward" if spec.mode == "backward" else "forward"
    with Progress(TextColumn("{task.description:<15}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        tasks = {"started": progress.add_task("ranks started", total=ranks),
                 phase: progress.add_task(phase, total=ranks),
                 "written": progress.add_task("dump written", total=ranks)}

        def on_event(event: dict) -> None:
            if event["event"] in tasks:
                progress.advance(tasks[event["event"]])

        return run(on_event)


def _run_hf(spec, stack: str, launcher: str, overwrite: bool) -> RunResult:
    """--stack hf: transformers in this process; it imports neither torchrun nor megatron."""
    if launcher == "none":
        raise UserError("--stack hf runs in this process; --launcher none is for megatron ranks")
    with console.status(f"{spec.mode} through transformers"):
        return run_in_process(spec, stack, overwrite)


def _run_here(spec, stack: str) -> Optional[RunResult]:
    """--launcher none: rank 0 draws every rank's progress and the summary; the other ranks stay quiet."""
    if os.environ.get("RANK", "0") != "0":
        return run_here(spec, stack, lambda event: None)
    return _with_progress(spec, spec.layout.world_size, lambda on_event: run_here(spec, stack, on_event))


def _summary(spec, result: RunResult, stack: str) -> None:
    layout = spec.layout
    lines = [("dump", str(result.out)) if result.landed else
             ("wrote", f"{result.out} (node 0 renames it to {spec.out} once every node has finished)"),
             ("run", f"{spec.mode}  {stack}  {layout.describe()}  {spec.dtype} on "
                     f"{spec.device}  model={spec.model.name}  loss-norm={spec.loss_norm}"
                     + (f"  packed: {spec.seq_len}-token rows" if spec.packed else "")),
             ("tensors", f"{result.tensors} records from {plural(result.ranks, 'rank')}"
                         + (f"  (values of --dump-only {spec.dump_only!r}, statistics of the rest)" if spec.dump_only
                            else "  (statistics only)" if spec.stats_only else "")),
             ("size", human_bytes(result.bytes))]
    if spec.save:
        lines.append(("saved", f"{spec.save} (Megatron distributed checkpoint, with {MODEL_FILE})"))
    if result.loss is not None:
        lines.append(("loss", f"{result.loss:.6f}"))
    lines.append(("time", f"{result.seconds:.1f} s"))
    for key, value in lines:
        console.print(f"[bold]{key:<8}[/] {shown(value)}", highlight=False, soft_wrap=True)
