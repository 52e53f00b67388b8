"""`megalign forward` and `megalign backward`: the same options, one command factory."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Literal, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from safetensors.torch import save_file

from megalign.compare.replay import check_fits, recorded_routing
from megalign.errors import RunFailed, UserError
from megalign.run.launch import (LaunchOptions, RunResult, check_options, launch, run_here, run_in_process,
                                           signals_as_interrupts)
from megalign.run.plan import RunRequest, plan_run
from megalign.stacks.batch import batch_rows
from megalign.cli.render import console, err_console, fail, human_bytes, plural


def run_command(mode: str):
    """Build the Typer command function for `mode` ("forward" or "backward")."""

    def command(
        out: Optional[Path] = typer.Option(None, "--out", "-o", metavar="DIR", show_default=False,
                                           help="Folder to write the dump to; must be empty or new unless "
                                                "--overwrite. Default: dumps/<mode>-tp<T>-pp<P>-cp<C>."),
        config: Optional[Path] = typer.Option(None, "--config", "-c", metavar="YAML",
                                              help="Model config (see configs/). Default: the embedded tiny model."),
        hf: Optional[Path] = typer.Option(None, "--hf", metavar="DIR",
                                          help="Hugging Face checkpoint folder (config.json + safetensors) of a "
                                               "Llama, Qwen2 or Qwen3 model; replaces --config. Default: none."),
        stack: Literal["megatron", "hf"] = typer.Option("megatron", "--stack",
                                        help="megatron: megatron-core workers under torchrun. hf: the --hf "
                                             "checkpoint through transformers in this process (one rank)."),
        tokens: Optional[Path] = typer.Option(None, "--tokens", metavar="JSON",
                                              help="Token ids, one list per sequence: [[1, 2, ...], ...]. Default: "
                                                   "2 built-in sequences of 32 and 20 tokens."),
        seq_len: Optional[int] = typer.Option(None, "--seq-len", metavar="N",
                                              help="Pad every sequence to N tokens (a multiple of 2*cp); with "
                                                   "--packed, the length of each packed row. Default: the longest "
                                                   "sequence (packed: the shortest row that holds them)."),
        packed: bool = typer.Option(False, "--packed",
                                    help="THD: pack each DP rank's sequences into one row (megatron's "
                                         "PackedSeqParams, cu_seqlens), every document padded to a multiple of "
                                         "2*cp (times tp with --sp), positions and attention restarting at every "
                                         "document, each document zigzagged over CP on its own. Default: off "
                                         "(one padded sequence a row)."),
        packed_split: Literal["document", "row"] = typer.Option(
            "document", "--packed-split",
            help="How --packed rows are split over CP: document (right: megatron's per-document zigzag). row "
                 "reproduces the classic bug: the row zigzagged as one long sequence "
                 "(use_per_sequence_balancing) while attention and RoPE expect documents."),
        tp: int = typer.Option(1, "--tp", metavar="N", help="Tensor-parallel size."),
        pp: int = typer.Option(1, "--pp", metavar="N", help="Pipeline-parallel size."),
        cp: int = typer.Option(1, "--cp", metavar="N", help="Context-parallel size (load-balanced zigzag layout)."),
        dp: Optional[int] = typer.Option(None, "--dp", metavar="N", show_default=False,
                                         help="Data-parallel size: the sequences are split over N ranks (N must divide "
                                              "their number); the loss is normalised over DP and CP together. "
                                              "Default: 1, or the DP size --ep needs."),
        ep: int = typer.Option(1, "--ep", metavar="N",
                               help="Expert-parallel size (MoE models): the experts split over N ranks, carved out "
                                    "of the TP x CP x DP ranks, as megatron does."),
        etp: Optional[int] = typer.Option(None, "--etp", metavar="N", show_default=False,
                                          help="Expert tensor-parallel size: 1 or --tp. Default: --tp."),
        moe_dispatcher: Literal["alltoall", "allgather"] = typer.Option(
            "alltoall", "--moe-dispatcher", help="megatron's MoE token dispatcher (moe_token_dispatcher_type)."),
        routing: str = typer.Option("record", "--routing", metavar="record|replay:DUMP",
                                    help="MoE routing. record: dump every router's logits, chosen experts and "
                                         "weights (kind routing). replay:DUMP: force the experts and weights "
                                         "DUMP recorded (same model and tokens, any layout or precision), "
                                         "through megatron's router replay; gradients still reach the router."),
        sp: bool = typer.Option(False, "--sp", help="Sequence parallelism (megatron's sequence_parallel): "
                                                    "activations outside attention and MLP split their sequence over "
                                                    "the TP ranks. Needs --tp > 1. Default: off."),
        distributed_optimizer: bool = typer.Option(
            False, "--distributed-optimizer", hidden=mode == "forward",
            help="DDP with use_distributed_optimizer: after backward each DP rank holds a shard of the gradients; "
                 "megalign gathers every parameter's full gradient from the shards. Default: off."),
        device: Literal["auto", "cpu", "cuda"] = typer.Option("auto", "--device",
                                   help="auto: cuda when available, else cpu. Backend: gloo on cpu, NCCL on cuda."),
        dtype: Literal["fp32", "bf16", "fp64"] = typer.Option(
            "fp32", "--dtype", help="Parameter and activation dtype. fp64 is the reference run for compare "
                                    "--reference: float64 throughout, no cast to float32 in either stack."),
        seed: int = typer.Option(1234, "--seed", metavar="N",
                                 help="Weight seed; every layout with the same seed holds identical weights."),
        attention: Literal["auto", "local", "torch", "te"] = typer.Option("auto", "--attention",
                                      help="Core attention: local = megatron's DotProductAttention (CP=1 only), "
                                           "torch = megalign's pure-torch CP attention, te = TransformerEngine. "
                                           "auto: te on cuda when installed, else local at CP=1 and torch at CP>1."),
        loss_norm: Literal["global", "local"] = typer.Option("global", "--loss-norm",
                                      help="global: divide the summed token loss by the valid-token count over "
                                           "all CP ranks (right). local: by each rank's own count (the classic CP "
                                           "bug: gradients scale by about CP)."),
        grad_source: Literal["auto", "grad", "main_grad", "shard"] = typer.Option(
                                        "auto", "--grad-source", hidden=mode == "forward",
                                        help="Where parameter gradients are read: auto = .grad, falling back to "
                                             "DDP's main_grad (gathered from the shards under "
                                             "--distributed-optimizer). grad reproduces the empty-dump bug under "
                                             "DDP; shard reads only this rank's distributed-optimizer shard, "
                                             "the other classic bug."),
        filter: Optional[str] = typer.Option(None, "--filter", metavar="REGEX",
                                             help="Only dump tensors whose name matches REGEX (inputs are always "
                                                  "dumped). Default: all."),
        stats_only: bool = typer.Option(False, "--stats-only",
                                        help="Write per-tensor statistics instead of values (for big models). "
                                             "Default: values."),
        overwrite: bool = typer.Option(False, "--overwrite",
                                       help="If --out is a megalign dump, delete it and write this run's dump in "
                                            "its place (only once this run has finished). Anything else in --out "
                                            "(files that are not a dump's) is never deleted: the run is refused. "
                                            "Default: refuse a non-empty --out."),
        timeout: float = typer.Option(600.0, "--timeout", metavar="SECONDS",
                                      help="Seconds before every worker is stopped and the run fails."),
        launcher: Literal["torchrun", "none"] = typer.Option("torchrun", "--launcher",
                                     help="torchrun: megalign starts the workers (torch.distributed.run). none: "
                                          "this process is one rank of a job you started with your own "
                                          "torchrun/srun (RANK, WORLD_SIZE, MASTER_ADDR set); rank 0 shows progress."),
        nnodes: int = typer.Option(1, "--nnodes", metavar="N", help="Number of nodes (as torchrun)."),
        node_rank: int = typer.Option(0, "--node-rank", metavar="N",
                                      help="This node's rank, in [0, --nnodes) (as torchrun)."),
        master_addr: Optional[str] = typer.Option(None, "--master-addr", metavar="HOST",
                                                  help="Rendezvous host of node 0 (as torchrun). Default: 127.0.0.1 "
                                                       "with --nnodes > 1, else a standalone rendezvous."),
        master_port: Optional[int] = typer.Option(None, "--master-port", metavar="PORT",
                                                  help="Rendezvous port of node 0 (as torchrun). Default: 29500."),
        rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", metavar="HOST:PORT",
                                                    help="A c10d rendezvous endpoint (as torchrun). Default: none."),
    ) -> None:
        out = out or Path("dumps") / (f"{mode}-hf" if stack == "hf" else
                                      f"{mode}-tp{tp}-pp{pp}-cp{cp}" + (f"-dp{dp}" if dp and dp > 1 else "") + ("-sp" if sp else "")
                                      + (f"-ep{ep}" if ep > 1 else "")
                                      + ("-thd" if packed else ""))
        request = RunRequest(mode=mode, out=out, config=config, hf=hf, stack=stack, tokens=tokens, seq_len=seq_len,
                             tp=tp, pp=pp, cp=cp, dp=dp, sp=sp, ep=ep, etp=etp, moe_dispatcher=moe_dispatcher,
                             distributed_optimizer=distributed_optimizer,
                             device=device, dtype=dtype, seed=seed, attention=attention, loss_norm=loss_norm,
                             grad_source=grad_source, filter=filter, stats_only=stats_only,
                             overwrite=overwrite, timeout_s=timeout, packed=packed, packed_split=packed_split)
        replay_dir = None
        try:
            if launcher == "none" and overwrite:
                raise UserError("--overwrite cannot be used with --launcher none (ranks would race to clear "
                                "the folder); remove --out first")
            spec = plan_run(request)
            replay_dir = _routing_replay(spec, stack, routing)
            spec = replace(spec, routing_replay=str(replay_dir / REPLAY_FILE)) if replay_dir else spec
            with signals_as_interrupts():
                if stack == "hf":
                    result = _run_hf(spec, stack, launcher, overwrite)
                elif launcher == "none":
                    result = _run_here(spec, stack)
                else:
                    options = LaunchOptions(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                                            master_port=master_port, rdzv_endpoint=rdzv_endpoint,
                                            overwrite=overwrite)
                    check_options(spec, options)
                    result = _with_progress(spec, spec.layout.world_size // nnodes,
                                            lambda on_event: launch(spec, stack, options, on_event))
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

    command.__doc__ = (
        "Run the model forward and dump activations, logits and logprobs." if mode == "forward" else
        "Run forward and backward and dump activations, activation gradients, parameter gradients, logits, "
        "logprobs and the loss.")
    return command


REPLAY_FILE = "routing.safetensors"


def _routing_replay(spec, stack: str, routing: str) -> Optional[Path]:
    """--routing replay:DUMP: the recorded choices, checked against this run, in a temporary folder of
    ours that the workers read (safetensors: no pickle); None for --routing record."""
    if routing == "record":
        return None
    kind, _, source = routing.partition(":")
    if kind != "replay" or not source:
        raise UserError(f"--routing {routing!r}: expected record or replay:DUMP")
    if not spec.model.is_moe or stack != "megatron":
        raise UserError("--routing replay needs a megatron run of an MoE model")
    recorded = recorded_routing(Path(source))
    check_fits(recorded, Path(source), spec.tokens, spec.model.to_dict())
    folder = Path(tempfile.mkdtemp(prefix="megalign-replay-"))
    choices = recorded.in_rows(batch_rows(spec))
    save_file({name: t.contiguous() for name, t in choices.items()}, str(folder / REPLAY_FILE))
    return folder


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
                         + ("  (statistics only)" if spec.stats_only else "")),
             ("size", human_bytes(result.bytes))]
    if result.loss is not None:
        lines.append(("loss", f"{result.loss:.6f}"))
    lines.append(("time", f"{result.seconds:.1f} s"))
    for key, value in lines:
        console.print(f"[bold]{key:<8}[/] {escape(value)}", highlight=False, soft_wrap=True)
