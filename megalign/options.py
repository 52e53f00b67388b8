"""The options of a run (`megalign forward|backward`), declared once: a tree of dataclasses.

Each leaf field is one command-line option: its name, type and default are the field's; its flag
spelling and help text are its metadata (`option(...)`). From this one declaration

- cli/run.py builds the Typer options of forward and backward; check takes its --mode's type and the
  spelling of the options it keeps for itself (--out, --overwrite) from here, and reads every other
  option as the run will (cli.run.parse_run, which gives a RunConfig);
- run/plan.py validates a RunConfig into the RunSpec (spec.py) that the workers receive, whose
  fields of the same names take their types and defaults from here.

The sections follow `megalign backward --help`, top to bottom.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from megalign.rollouts import formats as rollout_formats

Mode = Literal["forward", "backward"]
Stack = Literal["megatron", "hf"]
PackedSplit = Literal["document", "row"]
MoeDispatcher = Literal["alltoall", "allgather"]
Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["fp32", "bf16", "fp64"]
Attention = Literal["auto", "local", "torch", "te"]
LossNorm = Literal["global", "local"]
GradSource = Literal["auto", "grad", "main_grad", "shard"]
Launcher = Literal["torchrun", "none"]
Recompute = Literal["none", "full", "selective"]

FLAG = "flag"  # the metadata key of a field's Flag


@dataclass(frozen=True)
class Flag:
    """How an option is spelled on the command line and what --help says of it."""

    spelling: tuple[str, ...]  # ("--out", "-o")
    help: str
    metavar: Optional[str] = None
    show_default: bool = True
    backward_only: bool = False  # left out of forward's --help (it means nothing there, or forward refuses it)


def flag(section: type, name: str) -> Flag:
    """The Flag of option `name` of `section` (a class of the tree)."""
    return section.__dataclass_fields__[name].metadata[FLAG]


def option(default: Any, *spelling: str, help: str, **how: Any) -> Any:
    """A dataclass field that is the command-line option `spelling` (`how`: the rest of its Flag)."""
    return field(default=default, metadata={FLAG: Flag(spelling, help, **how)})


@dataclass(frozen=True)
class ModelSource:
    """Which model runs, and through which stack."""

    config: Optional[Path] = option(None, "--config", "-c", metavar="YAML",
                                    help="Model config (see configs/). Default: the embedded tiny model.")
    hf: Optional[Path] = option(None, "--hf", metavar="DIR",
                                help="Hugging Face checkpoint folder (config.json + safetensors) of a Llama, Qwen2 "
                                     "or Qwen3 model; replaces --config. Default: none.")
    load: Optional[Path] = option(None, "--load", metavar="DIR",
                                  help="Take the weights from a Megatron distributed checkpoint (torch_dist, as "
                                       "Megatron-LM and --save write it), resharded to this run's layout by "
                                       "megatron-core. Its model comes from the megalign.json --save writes beside "
                                       "it, else from --config or --hf. Default: none.")
    stack: Stack = option("megatron", "--stack",
                          help="megatron: megatron-core workers under torchrun. hf: the --hf checkpoint through "
                               "transformers in this process (one rank).")


@dataclass(frozen=True)
class Batch:
    """The token ids and how they are laid out in rows."""

    tokens: Optional[Path] = option(None, "--tokens", metavar="JSON",
                                    help="Token ids, one list per sequence: [[1, 2, ...], ...]. Default: 2 built-in "
                                         "sequences of 32 and 20 tokens.")
    rollout: Optional[Path] = option(None, "--rollout", metavar="FILE",
                                     help=f"An inference engine's rollout ({rollout_formats.described()}): run on its "
                                          "prompt + response tokens, the loss mask on the response; `megalign compare "
                                          "FILE DUMP` then compares the logprobs. Replaces --tokens. Default: none.")
    seq_len: Optional[int] = option(None, "--seq-len", metavar="N",
                                    help="Pad every sequence to N tokens (a multiple of 2*cp); with --packed, the "
                                         "length of each packed row. Default: the longest sequence (packed: the "
                                         "shortest row that holds them; --rollout: rounded up to a multiple of "
                                         "2*cp).")
    packed: bool = option(False, "--packed",
                          help="THD: pack each DP rank's sequences into one row (megatron's PackedSeqParams, "
                               "cu_seqlens), every document padded to a multiple of 2*cp (times tp with --sp), "
                               "positions and attention restarting at every document, each document zigzagged over "
                               "CP on its own. Default: off (one padded sequence a row).")
    packed_split: PackedSplit = option("document", "--packed-split",
                                       help="How --packed rows are split over CP: document (right: megatron's "
                                            "per-document zigzag). row reproduces the classic bug: the row zigzagged "
                                            "as one long sequence (use_per_sequence_balancing) while attention and "
                                            "RoPE expect documents.")


@dataclass(frozen=True)
class Parallelism:
    """How the model and the batch are split over ranks (spec.Layout, once validated), MoE included."""

    tp: int = option(1, "--tp", metavar="N", help="Tensor-parallel size.")
    pp: int = option(1, "--pp", metavar="N", help="Pipeline-parallel size.")
    cp: int = option(1, "--cp", metavar="N", help="Context-parallel size (load-balanced zigzag layout).")
    dp: Optional[int] = option(None, "--dp", metavar="N", show_default=False,
                               help="Data-parallel size: the sequences are split over N ranks (N must divide their "
                                    "number); the loss is normalised over DP and CP together. Default: 1, or the DP "
                                    "size --ep needs.")
    ep: int = option(1, "--ep", metavar="N",
                     help="Expert-parallel size (MoE models): the experts split over N ranks, carved out of the "
                          "TP x CP x DP ranks, as megatron does.")
    etp: Optional[int] = option(None, "--etp", metavar="N", show_default=False,
                                help="Expert tensor-parallel size: 1 or --tp. Default: --tp.")
    moe_dispatcher: MoeDispatcher = option("alltoall", "--moe-dispatcher",
                                           help="megatron's MoE token dispatcher (moe_token_dispatcher_type).")
    routing: str = option("record", "--routing", metavar="record|replay:DUMP",
                          help="MoE routing. record: dump every router's logits, chosen experts and weights (kind "
                               "routing). replay:DUMP: force the experts and weights DUMP recorded (same model and "
                               "tokens, any layout or precision), through megatron's router replay; gradients still "
                               "reach the router.")
    sp: bool = option(False, "--sp",
                      help="Sequence parallelism (megatron's sequence_parallel): activations outside attention and "
                           "MLP split their sequence over the TP ranks. Needs --tp > 1. Default: off.")
    distributed_optimizer: bool = option(False, "--distributed-optimizer", backward_only=True,
                                         help="DDP with use_distributed_optimizer: after backward each DP rank holds "
                                              "a shard of the gradients; megalign gathers every parameter's full "
                                              "gradient from the shards. Default: off.")


@dataclass(frozen=True)
class Numerics:
    """Where and how the numbers are computed."""

    device: Device = option("auto", "--device",
                            help="auto: cuda when available, else cpu. Backend: gloo on cpu, NCCL on cuda.")
    dtype: Dtype = option("fp32", "--dtype",
                          help="Parameter and activation dtype. fp64 is the reference run for compare --reference: "
                               "float64 throughout, no cast to float32 in either stack.")
    seed: int = option(1234, "--seed", metavar="N",
                       help="Weight seed; every layout with the same seed holds identical weights.")
    attention: Attention = option("auto", "--attention",
                                  help="Core attention: local = megatron's DotProductAttention (CP=1 only), torch = "
                                       "megalign's pure-torch CP attention, te = TransformerEngine. auto: te on cuda "
                                       "when installed, else local at CP=1 and torch at CP>1.")
    loss_norm: LossNorm = option("global", "--loss-norm",
                                 help="global: divide the summed token loss by the valid-token count over all CP "
                                      "ranks (right). local: by each rank's own count (the classic CP bug: gradients "
                                      "scale by about CP).")
    recompute: Recompute = option("none", "--recompute", backward_only=True,
                                  help="megatron's activation recomputation (recompute_granularity), as runs too "
                                       "big for their activations use it: full recomputes every layer in backward "
                                       "(recompute_method uniform, one layer a unit), selective its core attention "
                                       "(recompute_modules core_attn, megatron's default). Every tensor is still "
                                       "dumped once, under the name it has without recomputation.")
    grad_source: GradSource = option("auto", "--grad-source", backward_only=True,
                                     help="Where parameter gradients are read: auto = .grad, falling back to DDP's "
                                          "main_grad (gathered from the shards under --distributed-optimizer). grad "
                                          "reproduces the empty-dump bug under DDP; shard reads only this rank's "
                                          "distributed-optimizer shard, the other classic bug.")


@dataclass(frozen=True)
class Output:
    """What is written, and what may be replaced."""

    filter: Optional[str] = option(None, "--filter", metavar="REGEX",
                                   help="Only dump tensors whose name matches REGEX (inputs are always dumped). "
                                        "Default: all.")
    stats_only: bool = option(False, "--stats-only",
                              help="Write per-tensor statistics instead of values (for big models). Default: values.")
    dump_only: Optional[str] = option(None, "--dump-only", metavar="[STEP:]REGEX",
                                      help="Values only for the tensors whose name matches REGEX (of step STEP, "
                                           "where the dump has steps), statistics as --stats-only writes them for "
                                           "every other: how megalign check --zoom dumps the tensors around the "
                                           "first divergence. Default: values for every tensor.")
    save: Optional[Path] = option(None, "--save", metavar="DIR",
                                  help="Also write this run's weights as a Megatron distributed checkpoint (torch_dist) "
                                       "in DIR, new or empty and neither inside --out nor holding it, with "
                                       "megalign.json (the model) beside them, so that --load DIR needs no --config. "
                                       "Default: none.")
    overwrite: bool = option(False, "--overwrite",
                             help="If --out is a megalign dump, delete it and write this run's dump in its place "
                                  "(only once this run has finished). Anything else in --out (files that are not a "
                                  "dump's) is never deleted: the run is refused. Default: refuse a non-empty --out.")


@dataclass(frozen=True)
class Launch:
    """How the worker processes are started, and how long they may take."""

    timeout_s: float = option(600.0, "--timeout", metavar="SECONDS",
                              help="Seconds before every worker is stopped and the run fails.")
    launcher: Launcher = option("torchrun", "--launcher",
                                help="torchrun: megalign starts the workers with torchrun (on a CPU forked from one process that has imported megatron-core). none: this "
                                     "process is one rank of a job you started with your own torchrun/srun (RANK, "
                                     "WORLD_SIZE, MASTER_ADDR set); rank 0 shows progress.")
    nnodes: int = option(1, "--nnodes", metavar="N", help="Number of nodes (as torchrun).")
    node_rank: int = option(0, "--node-rank", metavar="N", help="This node's rank, in [0, --nnodes) (as torchrun).")
    master_addr: Optional[str] = option(None, "--master-addr", metavar="HOST",
                                        help="Rendezvous host of node 0 (as torchrun). Default: 127.0.0.1 with "
                                             "--nnodes > 1, else a standalone rendezvous.")
    master_port: Optional[int] = option(None, "--master-port", metavar="PORT",
                                        help="Rendezvous port of node 0 (as torchrun). Default: 29500.")
    rdzv_endpoint: Optional[str] = option(None, "--rdzv-endpoint", metavar="HOST:PORT",
                                          help="A c10d rendezvous endpoint (as torchrun). Default: none.")


@dataclass(frozen=True)
class RunConfig:
    """A run as the user asked for it: `mode` is the command (forward or backward), every other leaf an option."""

    mode: Mode
    out: Optional[Path] = option(None, "--out", "-o", metavar="DIR", show_default=False,
                                 help="Folder to write the dump to; must be empty or new unless --overwrite. "
                                      "Default: dumps/<mode>-tp<T>-pp<P>-cp<C>.")
    source: ModelSource = field(default_factory=ModelSource)
    batch: Batch = field(default_factory=Batch)
    parallel: Parallelism = field(default_factory=Parallelism)
    numerics: Numerics = field(default_factory=Numerics)
    output: Output = field(default_factory=Output)
    launch: Launch = field(default_factory=Launch)

    @classmethod
    def from_options(cls, mode: Mode, values: dict[str, Any]) -> "RunConfig":
        """The tree from one value per option, keyed by field name (as the command line gives them)."""
        return _build(cls, values, mode=mode)

    def dump_folder(self) -> Path:
        """--out, else dumps/<mode>-tp<T>-pp<P>-cp<C>, with -dp<D>, -sp, -ep<E> and -thd where they apply."""
        if self.out is not None:
            return self.out
        if self.source.stack == "hf":
            return Path("dumps") / f"{self.mode}-hf"
        p = self.parallel
        return Path("dumps") / (f"{self.mode}-tp{p.tp}-pp{p.pp}-cp{p.cp}" + (f"-dp{p.dp}" if p.dp and p.dp > 1 else "")
                                + ("-sp" if p.sp else "") + (f"-ep{p.ep}" if p.ep > 1 else "")
                                + ("-thd" if self.batch.packed else ""))


def _build(section: type, values: dict[str, Any], **given: Any) -> Any:
    return section(**given, **{f.name: _build(hint, values) if dataclasses.is_dataclass(hint) else values[f.name]
                               for f, hint in _fields(section) if f.name not in given})


def _fields(section: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(section)
    return ((f, hints[f.name]) for f in dataclasses.fields(section))


def option_fields(section: type = RunConfig) -> Iterator[tuple[dataclasses.Field, Any]]:
    """Every option of the tree, in --help order: (field, its type), the type resolved from its annotation."""
    for f, hint in _fields(section):
        if dataclasses.is_dataclass(hint):
            yield from option_fields(hint)
        elif FLAG in f.metadata:
            yield f, hint
