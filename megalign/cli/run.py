"""`megalign forward` and `megalign backward`: the same options, one command factory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from megalign.alignment.errors import RunFailed, UserError
from megalign.alignment.launch import LaunchOptions, RunResult, launch
from megalign.alignment.plan import RunRequest, plan_run
from megalign.cli.render import console, err_console, fail, human_bytes

LAYOUT = "Layout"
RUN = "Run"
DUMP = "Dump"
LAUNCH = "Launcher (multi-node and own launchers)"


def run_command(mode: str):
    """Build the Typer command function for `mode` ("forward" or "backward")."""

    def command(
        out: Optional[Path] = typer.Option(None, "--out", "-o", rich_help_panel=DUMP,
                                           help="Folder to write the dump to "
                                                "(default: dumps/<mode>-tp<T>-pp<P>-cp<C>)."),
        config: Optional[Path] = typer.Option(None, "--config", "-c", rich_help_panel=RUN,
                                              help="Model config YAML (see configs/) (default: embedded tiny model)."),
        hf: Optional[Path] = typer.Option(None, "--hf", rich_help_panel=RUN,
                                          help="Hugging Face checkpoint folder (config.json + safetensors) of a "
                                               "Llama, Qwen2 or Qwen3 model; replaces --config."),
        stack: Literal["megatron", "hf"] = typer.Option("megatron", "--stack", rich_help_panel=RUN,
                                        help="megatron: megatron-core workers under torchrun. hf: the --hf "
                                             "checkpoint through transformers in this process (one rank)."),
        tokens: Optional[Path] = typer.Option(None, "--tokens", rich_help_panel=RUN,
                                              help="JSON file of token ids, one list per sequence (default: 2 built-in "
                                                   "sequences of 32 and 20 tokens)."),
        seq_len: Optional[int] = typer.Option(None, "--seq-len", rich_help_panel=RUN,
                                              help="Pad every sequence to this length (default: the longest). "
                                                   "Must be a multiple of 2*cp."),
        tp: int = typer.Option(1, "--tp", rich_help_panel=LAYOUT, help="Tensor-parallel size."),
        pp: int = typer.Option(1, "--pp", rich_help_panel=LAYOUT, help="Pipeline-parallel size."),
        cp: int = typer.Option(1, "--cp", rich_help_panel=LAYOUT,
                               help="Context-parallel size (load-balanced zigzag layout)."),
        device: Literal["auto", "cpu", "cuda"] = typer.Option("auto", "--device", rich_help_panel=RUN,
                                   help="auto: cuda when available, else cpu. Backend: gloo on cpu, NCCL on cuda."),
        dtype: Literal["fp32", "bf16"] = typer.Option("fp32", "--dtype", rich_help_panel=RUN,
                                  help="Parameter and activation dtype."),
        seed: int = typer.Option(1234, "--seed", rich_help_panel=RUN,
                                 help="Weight seed; every layout with the same seed holds identical weights."),
        attention: Literal["auto", "local", "torch", "te"] = typer.Option("auto", "--attention", rich_help_panel=RUN,
                                      help="Core attention: local = megatron's DotProductAttention (CP=1 only), "
                                           "torch = megalign's pure-torch CP attention, te = TransformerEngine. "
                                           "auto: te on cuda when installed, else local at CP=1 and torch at CP>1."),
        loss_norm: Literal["global", "local"] = typer.Option("global", "--loss-norm", rich_help_panel=RUN,
                                      help="global: divide the summed token loss by the valid-token count over "
                                           "all CP ranks (right). local: by each rank's own count (the classic CP "
                                           "bug: gradients scale by about CP)."),
        grad_source: Literal["auto", "grad", "main_grad"] = typer.Option(
                                        "auto", "--grad-source", rich_help_panel=DUMP, hidden=mode == "forward",
                                        help="Where parameter gradients are read: auto = .grad, falling back to "
                                             "DDP's main_grad; grad reproduces the empty-dump bug under DDP."),
        filter: Optional[str] = typer.Option(None, "--filter", rich_help_panel=DUMP,
                                             help="Only dump tensors whose name matches this regex (inputs are "
                                                  "always dumped)."),
        stats_only: bool = typer.Option(False, "--stats-only", rich_help_panel=DUMP,
                                        help="Write per-tensor statistics instead of values (for big models)."),
        overwrite: bool = typer.Option(False, "--overwrite", rich_help_panel=DUMP,
                                       help="Replace a non-empty --out folder."),
        timeout: float = typer.Option(600.0, "--timeout", rich_help_panel=RUN,
                                      help="Seconds before every worker is stopped and the run fails."),
        launcher: Literal["torchrun", "none"] = typer.Option("torchrun", "--launcher", rich_help_panel=LAUNCH,
                                     help="torchrun: megalign starts the workers (torch.distributed.run). none: "
                                          "this process is one rank of a job you started with your own "
                                          "torchrun/srun (RANK, WORLD_SIZE, MASTER_ADDR set)."),
        nnodes: int = typer.Option(1, "--nnodes", rich_help_panel=LAUNCH, help="Number of nodes (as torchrun)."),
        node_rank: int = typer.Option(0, "--node-rank", rich_help_panel=LAUNCH, help="This node's rank (as torchrun)."),
        master_addr: Optional[str] = typer.Option(None, "--master-addr", rich_help_panel=LAUNCH,
                                                  help="Rendezvous host of node 0 (as torchrun)."),
        master_port: Optional[int] = typer.Option(None, "--master-port", rich_help_panel=LAUNCH,
                                                  help="Rendezvous port of node 0 (as torchrun) (default: 29500)."),
        rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", rich_help_panel=LAUNCH,
                                                    help="host:port of a c10d rendezvous (as torchrun)."),
    ) -> None:
        out = out or Path("dumps") / (f"{mode}-hf" if stack == "hf" else f"{mode}-tp{tp}-pp{pp}-cp{cp}")
        request = RunRequest(mode=mode, out=out, config=config, hf=hf, stack=stack, tokens=tokens, seq_len=seq_len,
                             tp=tp, pp=pp, cp=cp,
                             device=device, dtype=dtype, seed=seed, attention=attention, loss_norm=loss_norm,
                             grad_source=grad_source, filter=filter, stats_only=stats_only,
                             overwrite=overwrite, timeout_s=timeout)
        try:
            if launcher == "none" and overwrite:
                raise UserError("--overwrite cannot be used with --launcher none (ranks would race to clear "
                                "the folder); remove --out first")
            spec = plan_run(request)
            if stack == "hf":
                result = _run_hf(spec, launcher, overwrite)
            elif launcher == "none":
                _run_here(spec)
                return
            else:
                options = LaunchOptions(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                                        master_port=master_port, rdzv_endpoint=rdzv_endpoint, overwrite=overwrite)
                result = _launch_with_progress(spec, options)
        except UserError as e:
            fail(str(e), 2)
        except RunFailed as e:
            if e.details:
                err_console.print(e.details, style="dim", markup=False, highlight=False, soft_wrap=True)
            fail(str(e), 1)
        _summary(spec, result, stack)

    command.__doc__ = (
        "Run the model forward and dump activations, logits and logprobs." if mode == "forward" else
        "Run forward and backward and dump activations, activation gradients, parameter gradients, logits, "
        "logprobs and the loss.")
    return command


def _launch_with_progress(spec, options: LaunchOptions) -> RunResult:
    world = spec.layout.world_size // options.nnodes
    phase = "backward" if spec.mode == "backward" else "forward"
    with Progress(TextColumn("{task.description:<15}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        tasks = {"started": progress.add_task("ranks started", total=world),
                 phase: progress.add_task(phase, total=world),
                 "written": progress.add_task("dump written", total=world)}

        def on_event(event: dict) -> None:
            if event["event"] in tasks:
                progress.advance(tasks[event["event"]])

        return launch(spec, options, on_event)


def _run_hf(spec, launcher: str, overwrite: bool) -> RunResult:
    """--stack hf: transformers in this process; it imports neither torchrun nor megatron."""
    from megalign.alignment.hf.stack import run_hf

    if launcher == "none":
        raise UserError("--stack hf runs in this process; --launcher none is for megatron ranks")
    with console.status(f"{spec.mode} through transformers"):
        return run_hf(spec, overwrite=overwrite)


def _run_here(spec) -> None:
    """--launcher none: this process is one rank; rank 0 writes dump.json last, after every rank."""
    from megalign.alignment.worker import run_worker

    if not os.environ.get("WORLD_SIZE"):
        raise UserError("--launcher none expects RANK and WORLD_SIZE from your torchrun/srun")
    if int(os.environ["WORLD_SIZE"]) != spec.layout.world_size:
        raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but tp*pp*cp={spec.layout.world_size}")
    run_worker(spec)


def _summary(spec, result: RunResult, stack: str) -> None:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    layout = spec.layout
    table.add_row("dump", str(result.out))
    table.add_row("run", f"{spec.mode}  {stack}  tp={layout.tp} pp={layout.pp} cp={layout.cp}  "
                         f"{spec.dtype} on {spec.device}"
                         f"  model={spec.model.name}  loss-norm={spec.loss_norm}")
    table.add_row("tensors", f"{result.tensors} records from {result.ranks} ranks"
                             + ("  (statistics only)" if spec.stats_only else ""))
    table.add_row("size", human_bytes(result.bytes))
    if result.loss is not None:
        table.add_row("loss", f"{result.loss:.6f}")
    table.add_row("time", f"{result.seconds:.1f} s")
    console.print(table)
