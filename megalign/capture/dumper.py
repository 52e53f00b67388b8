"""`megalign.Dumper`: write a megalign dump from any process, one that `megalign compare` reads.

    with megalign.Dumper("dumps/mine") as dumper:
        dumper.watch(model)                  # every submodule's output, and its gradient
        with dumper.step(0):                 # at the end: the parameter gradients of watched modules
            model(x).sum().backward()
        dumper.add("loss", "loss", loss)     # anything else, with its sharding where it is split

What a watched model's tensors are named, how they are split, where its gradients are read: its
framework's adapter says (capture/adapter.py; megatron_adapter.py, torch_adapter.py); the Dumper
keeps the steps, the writing and the landing. megalign's own workers (stacks/megatron/worker.py,
stacks/hf/worker.py) write through this class too, with `add` and the sharding they infer. Each rank writes through writer.py's RankWriter, into
the staging folder of landing.py (OUT.partial, claimed exclusively), renamed to OUT by rank 0 at
close once every rank's manifest is written, with dump.json (meta.py). A failure inside the `with`
block removes the staging folder: OUT never holds half a dump. A megalign run's launcher claims
and lands the folder itself (it outlives a killed worker): its workers pass `claim=False`.

Ranks: one process is rank 0 of 1. Under torchrun the rank is torch.distributed's; the layout is
megatron-core's parallel_state where it is initialised, otherwise every rank is a DP rank.

Steps: `step(n)` collects the parameter gradients (and, with `params=True`, the parameters) when its
block ends; dump.json lists the steps written, and each rank's manifest marks where each step's
records begin ("steps": [[n, first record], ...]). compare names a dump's tensors by step where it
holds several (`step1/name`); `steps=` picks the steps written (capture/steps.py).

In a user's trainer, `Dumper.from_env()` is the one line: MEGALIGN_DUMP=DIR turns dumping on
(unset, a NullDumper that installs nothing), and MEGALIGN_* variables set keywords (ENVIRONMENT).
"""

from __future__ import annotations

import contextlib
import operator
import os
import re
import time
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from megalign.capture import megatron_adapter, torch_adapter
from megalign.capture.adapter import Adapter, Sink, View
from megalign.capture.coverage import collective_device, read_grad
from megalign.capture.ddp_grads import sharded
from megalign.capture.dtensor import is_dtensor, local_piece
from megalign.capture.grad_reads import GradReads
from megalign.capture.hooks import Hooks
from megalign.capture.megatron_router import expert_bias_update
from megalign.capture.recompute import AwaitingGradients, recomputing
from megalign.capture.reducers import Reducers, Stated, check_stated
from megalign.capture.rows import RowLog, rows_meta
from megalign.capture.steps import Steps, choose_steps
from megalign.dump.grad_convention import META_KEY as REDUCTION
from megalign.dump.format import (DUMP_META, KINDS, PRECISIONS, Kind, RankCoords, TensorRecord, check_name, dtype_name,
                                  layer_of, precision_name, write_json_atomic)
from megalign.dump.landing import DUMPER_OUT as OUT, check_out, staged, staging_dir
from megalign.dump.layout import CP_SPLITS, BatchRow, Layout, cp_split_bounds
from megalign.dump.meta import EXPERT_BIAS_UPDATE, dump_meta
from megalign.dump.partial import check_partial, partial_piece
from megalign.dump.sharding import Sharding
from megalign.dump.writer import RankWriter, check_storable
from megalign.dump.zoom import FullValues, full_values
from megalign.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


# What backward makes: recorded whenever it comes. Anything else recorded while a forward is
# recomputed (an activation, a router's decisions) was recorded in its first forward.
_GRADIENTS = frozenset({Kind.ACTIVATION_GRAD, Kind.PARAM_GRAD})


class Dumper:
    """Writes one megalign dump into `out`, which must be new or empty (`overwrite=True` replaces an
    existing megalign dump, never anything else: the rule of `megalign backward --overwrite`).

    Every rank of a torchrun job makes its own Dumper with the same `out`. The dump appears at
    `close()` (or at the end of a `with` block), all at once; a refused `out` raises UserError on
    every rank before anything is written.

    `stats_only`: per-tensor statistics instead of values. `dump_only`: values only for the tensors it
    names ("STEP:REGEX", or "REGEX" in every step: dump/zoom.py), statistics for every other, as
    `stats_only` writes them: a zoom into the first divergence a stats-only pass found. `name_filter`: a regex; only tensors whose
    name it finds are written (inputs always). `claim=False`: `out` is a folder a launcher has
    claimed and will land (megalign's runs): every rank writes into it as it is, and rank 0 adds
    dump.json at close. `steps`: which steps are written ("all" or None, a step, a list of steps,
    "1,2", "every:K"); other than "all", nothing is written outside a chosen step's block. `params`:
    each step's end also dumps the watched parameters (kind param), so that an optimizer bug shows at
    the next step.
    `dp_group`: without megatron-core's parallel_state, this rank's data-parallel group where it is
    not the whole world (the `process_group` given to torch DDP, or a 1-D DeviceMesh: `mesh["dp"]`):
    plain parameters are replicas, and outputs split on `batch_dim`, over that group only. The
    groups, of one size, split the world into stages, each with names of its own (pipeline stages
    that keep the model's module names); a name several stages hold is read as their replica.
    `dtype`: the precision the run computed in ("bf16", "fp16", "fp32", "fp64" or a torch float dtype),
    dump.json's dtype, which sets compare's thresholds, where the Dumper cannot see it (a model cast to
    bf16 that keeps fp32 gradients, tensors upcast before add()). None: autocast's 16-bit dtype where
    a tensor was recorded under torch.autocast, else the widest float dtype recorded.
    `grad_reduction`: how the ranks' parameter gradients are reduced, where the Dumper cannot read it
    (a DDP comm hook of yours): "sum", "mean" (over the DP ranks) or the divisor of their sum; read
    from a watched torch DDP or FSDP2 otherwise (reducers.py).
    """

    enabled = True

    def __init__(self, out, *, overwrite: bool = False, stats_only: bool = False,
                 name_filter: Optional[str] = None, claim: bool = True, steps: Steps = "all",
                 params: bool = False, dp_group: Union[dist.ProcessGroup, "DeviceMesh", None] = None,
                 dtype: Union[str, torch.dtype, None] = None, grad_reduction: Stated = None,
                 dump_only: Union[str, FullValues, None] = None):
        self._choice = choose_steps(steps)
        self._full = None if dump_only is None else full_values(dump_only)
        self._stated_reduction = check_stated(grad_reduction)
        self._reducers = Reducers()  # the watched DDPs and FSDP2 modules: how they reduce, read at close
        self._precision = None if dtype is None else _stated_precision(dtype)
        self._autocast: set[str] = set()  # the precisions autocast computed recorded tensors in
        self._params = params
        self._writing = self._choice.all  # outside a step block: only when every step is wanted
        self.out = Path(out).absolute()  # the program may change its working folder before close()
        self.coords, self.layout, self._dp_ranks = _place(dp_group)
        self._world = self.layout.world_size
        self._landing = contextlib.ExitStack()  # holds the claimed staging folder until close()
        if claim:
            def claim_out() -> None:
                check_out(self.out, overwrite, flag=OUT)
                self._landing.enter_context(staged(self.out, overwrite, flag=OUT))

            self._on_rank_zero(claim_out)
        self._folder = staging_dir(self.out) if claim else self.out  # where the ranks write
        self._writer = RankWriter(self._folder, self.coords, stats_only=stats_only or self._full is not None,
                                  name_filter=name_filter)
        self._writer.layout = self.layout
        # parameter name -> the parameter, of watched modules, and the adapter of the model it is in
        self._watched: dict[str, tuple[torch.nn.Parameter, Adapter]] = {}
        self._hooks = Hooks()
        # param_grad read when the reduction completes, and again as the optimizer steps (grad_reads.py)
        self._reads = GradReads(self._dump_grads, self._held_grads, self._writer.discard,
                                lambda: self._writing and self._step_now is not None,
                                lambda: self.layout.dp == 1 or self._reducers.reduce_in_backward(),
                                lambda now: self._writer.stats_only and self._full is None and now.device.type != "cpu",
                                self._writer.kept_if)
        self._hooked: weakref.WeakSet = weakref.WeakSet()  # the modules whose outputs are watched (a model may go)
        # This DP rank's rows as the model saw them in each dumped step: its packed (THD) row, or its
        # padded rows where watch() was given seq_dim; every DP rank's, gathered at close (rows.py).
        self._row_log = RowLog()
        self._row_logs: dict[int, RowLog] = {}
        self._step_now: Optional[int] = None
        self._awaiting = AwaitingGradients()  # outputs recorded under recomputation's no_grad (recompute.py)
        self._packed = False
        self._cp_split = "document"
        self._steps: list[int] = []
        self._bias_update: Optional[float] = None  # megatron's routers' expert_bias update rate (megatron_router.py)
        self._marks: list[list[int]] = []  # [step, its first record's order] of each step written
        self._closed = False
        # Only this process writes, lands or removes the dump: a forked child holds a copy of the
        # Dumper, and its exit ran the at-exit hook below, which removed the parent's staging folder.
        self._pid = os.getpid()
        # A Dumper the program never closes writes nothing: said at the latest when the program
        # ends, and its staging folder removed (megalign's own runs, claim=False, land theirs).
        self._unclosed = (weakref.finalize(self, _never_closed, str(self.out), self._landing, self._pid)
                          if claim else None)

    @classmethod
    def from_env(cls, **options) -> Union["Dumper", "NullDumper"]:
        """The one line for a trainer: a Dumper writing to $MEGALIGN_DUMP or, with MEGALIGN_DUMP
        unset or empty, a NullDumper whose methods do nothing. `options`: the Dumper's keyword
        arguments; each variable of ENVIRONMENT that is set and not empty overrides its keyword."""
        out = os.environ.get("MEGALIGN_DUMP")
        if not out:
            return NullDumper()
        if out != out.strip():  # MEGALIGN_DUMP=" " made a folder named " "
            raise UserError(f"MEGALIGN_DUMP={out!r} starts or ends with a blank: give the folder without them, or "
                            "leave MEGALIGN_DUMP unset or empty to dump nothing")
        for variable, (keyword, read) in ENVIRONMENT.items():
            if text := os.environ.get(variable):
                try:
                    options[keyword] = read(text, variable)
                except ValueError as error:  # the keyword's own check, said of the variable
                    raise UserError(str(error)) from None
        return cls(out, **options)

    @property
    def records(self) -> list[TensorRecord]:
        """What this rank has written so far."""
        return self._writer.records

    @property
    def bytes_written(self) -> int:
        """This rank's bytes of tensor data, known after close()."""
        return self._writer.bytes_written

    def wants(self, kind: str, name: str) -> bool:
        """Whether (kind, name) passes the name filter: a caller can skip the work of making it."""
        return self._writer.wants(kind, name)

    def add(self, kind: str, name: str, tensor: torch.Tensor, sharding: Optional[Sharding] = None, *,
            module: Optional[str] = None, stable: bool = False) -> None:
        """Record `tensor` (copied now) as (kind, name). `sharding` says how this rank's tensor is a
        piece of the whole (megalign.Sharding: `dp_dim`, `seq_dim` (CP zigzag), `tp_dim`, `tp_parts`,
        `sp`); None: every rank holds the whole tensor, a replica. A DTensor's own placements say where
        its local piece lies (dtensor.py). `module`: the module that made it, if any. `stable`: the
        tensor will not change before close() (a parameter gradient after the step), so it is
        written from where it is, not copied."""
        self._check_open("add")
        self._record(kind, name, tensor, sharding, module=module, stable=stable)

    def _record(self, kind: str, name: str, tensor: torch.Tensor, sharding: Optional[Sharding] = None, *,
                module: Optional[str] = None, stable: bool = False, unless_zero: bool = False,
                call: Optional[int] = None) -> None:
        """add(); `unless_zero`: left out of the dump if its statistics say it is all zero; `call`: an
        activation gradient's forward call (TensorRecord.call)."""
        # What add() refuses, it refuses in every step: not first in the one chosen, long into a run.
        if reason := check_name(name):
            raise ValueError(f"{kind} {reason}")
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{kind} {name}: a torch.Tensor is needed, got {type(tensor).__name__}")
        check_storable(kind, name, tensor)
        if sharding is not None and sharding.partial is not None:
            check_partial(sharding, f"{kind} {name}")
        if not self._writing or (kind not in _GRADIENTS and recomputing()):  # recorded in the first forward
            return
        if is_dtensor(tensor):
            if sharding not in (None, Sharding()):
                raise ValueError(f"{kind} {name}: a DTensor's placements say how it is split; pass no sharding")
            tensor, sharding = local_piece(tensor)
        if sharding is not None and sharding.partial is not None:
            tensor, sharding = partial_piece(tensor, sharding, self.coords, self.layout)
        if (precision := _autocast_precision(tensor)) is not None:
            self._autocast.add(precision)
        self._writer.add(kind, name, tensor, sharding or Sharding(), module=module,
                         layer=layer_of(module or name), stable=stable, unless_zero=unless_zero, call=call,
                         full=self._in_full(name))

    def add_output(self, kind: str, name: str, tensor: torch.Tensor, sharding: Sharding, *, view: View = None,
                   module: Optional[str] = None, grad: bool = True, grad_sharding: Optional[Sharding] = None) -> None:
        """add() a module's output `tensor` (through `view`, if any) as (kind, name) and, with `grad`,
        its gradient as activation_grad when backward reaches it. A leaf, a parameter the module
        returns as it is (megatron's linears return their skipped bias so), gets no gradient: that
        is the parameter's, summed over this rank's tokens only, whole in param_grad. The gradient
        takes this call's place among the name's repeats, however late backward reaches it. A call
        that recomputes an activation (capture/recompute.py) records only its gradient, in the place
        of the call it recomputes.
        `grad_sharding`: the gradient's, where it lies otherwise (partial sums of a replica output)."""
        view = view or (lambda t: t)
        grad = grad and self.wants(Kind.ACTIVATION_GRAD, name)
        if recomputing():
            call = self._awaiting.recomputed(name) if grad else None
            if call is None:
                return
        else:
            call = len(self.records)  # the order this call's output is recorded at
            if self.wants(kind, name):
                self.add(kind, name, view(tensor), sharding, module=module)
            if grad and not torch.is_grad_enabled():
                self._awaiting.wait(name, call)
        if grad and tensor.requires_grad and not tensor.is_leaf:
            def on_grad(gradient: Optional[torch.Tensor]) -> None:
                if gradient is not None:
                    self._check_open("add")
                    self._record(Kind.ACTIVATION_GRAD, name, view(gradient), grad_sharding or sharding, module=module,
                                 call=call)

            tensor.register_hook(on_grad)

    def watch(self, module: torch.nn.Module, prefix: str = "", batch_dim: Optional[int] = 0,
              outputs: bool = True, cp_split: str = "document", seq_dim: Optional[int] = None) -> None:
        """Dump the output of every submodule of `module` (kind activation, named by its path, with
        `prefix.` before it; a tuple's further outputs as `name#1`, ...), the gradient of each output
        when backward reaches it (activation_grad), and, at the end of each `step`, the parameter
        gradients (param_grad). `outputs=False`: the parameters' gradients (and values) only.

        A megatron-core model (GPTModel, or the megatron-core DDP wrapping it; its gradients are read
        where DDP leaves them) needs nothing declared: how each output is split under TP, sequence
        parallelism, CP and DP is inferred as megalign's own megatron worker infers it
        (capture/megatron_outputs.py), from the model's TransformerConfig and the input_ids [b, s] of
        each forward call (this rank's share of the batch). The CP split read is megatron's zigzag
        (rank r holds chunks r and 2*CP-1-r of every sequence, as megatron.core.utils.
        get_batch_on_this_cp_rank gives them; another split would read as a divergence). Packed (THD)
        rows: the documents are read from the packed_seq_params of each forward call (cu_seqlens_q,
        and cu_seqlens_q_padded where the documents are padded), one packed row a DP rank (split per
        document over CP ranks: the same in every dumped step); `cp_split` says how the row was split over
        CP ranks: "document", every document zigzagged on its own (get_batch_on_this_cp_rank given cu_seqlens, TE's
        thd_get_partitioned_indices), or "row", the row zigzagged as one sequence. PP stages: each stage's
        layers are named by their global index, as megalign's worker names them (megatron_names.py), and
        so are EP ranks' experts (`mlp.experts.<e>`). The MLP's activation, linear_fc2's input, is dumped
        too (as `...linear_fc2#input`); an MoE layer's experts' outputs are not (permuted tokens, no
        sequence layout), its router's decisions are, as the worker's (kind routing: `<router>.experts`
        and `.weights`, [s, b, topk]; not its logits). Routers whose expert_bias megatron's
        finalize_model_grads moves after every step are said so in dump.json (their update rate), which
        compare reports beside the dump: a stack that keeps the bias routes otherwise from the next step.
        Under activation recomputation (megatron-core's, torch's checkpoint) each output and its gradient
        are recorded once, as without it (capture/recompute.py).

        Any other module: `batch_dim` is the outputs' batch dim, split over DP ranks (None: every rank
        computes the same outputs); an output is split only where it has as many rows there as the
        first tensor `module` was called with (the rest, rotary tables, are replicas). `seq_dim`: the
        dim of that tensor (input_ids [batch, seq]: 1) and of the outputs that holds the tokens; an
        output with as many there is recorded as a token tensor, and the rows' real tokens are read
        from the call's `attention_mask` [batch, seq] (by name or position; 1 real, 0 padding,
        right-padded; none: every token real), step by step, so that compare lines up runs padded or
        packed differently token by token (compare/lineup.py). Rows that cannot be recorded (a 4D or
        left-padded mask, DP ranks padded to different lengths) are dropped with a warning, never
        raised mid-step (capture/rows.py). torch's DDP is unwrapped (names as the model's own; its
        process_group must be the Dumper's DP group: `dp_group`); FSDP2 and tensor parallel's
        DTensors are placed by their placements. Under parallelize_module the ranks are placed again,
        TP over the parallelized parameters' mesh (watch such a model before any add()), and the
        outputs read are each parallelized module's, as the DTensor its forward returns, and any
        DTensor output (other plain outputs, local pieces or replicas, are left out). Pipeline stages (`dp_group`) keep the whole model's
        module names. Under megatron-core's TP or CP, NotImplementedError (add() each tensor with its
        megalign.Sharding). A module watched already is refused (its tensors would be dumped twice), and so is
        a module or parameter named as a repeat reads (`expert@1`: add() would refuse its tensors mid-run).
        Outputs are tensors, or tuples and lists of them; a dict's values (a ModelOutput's) are not
        read: add() them. A refusal aborts the Dumper: no staging folder is left behind."""
        self._check_open("watch")
        self._reducers.watch(module)
        with self._refusal_aborts():
            self._watch(module, prefix, batch_dim, outputs, cp_split, seq_dim)

    def hook_outputs(self, module: torch.nn.Module, adapter: Adapter) -> None:
        """Dump every output of `module` and its gradient as `adapter` hooks them (capture/adapter.py),
        and not its parameters (docs/python-api.md): megalign's megatron and transformers workers,
        whose adapters write what their runs dump beyond a user's model and which read their
        gradients themselves."""
        self._check_open("hook_outputs")
        with self._refusal_aborts():
            self._hook_outputs(adapter, module, adapter.name, "document", None)

    @contextlib.contextmanager
    def _refusal_aborts(self) -> Iterator[None]:
        """A refused watch aborts the Dumper: no staging folder is left behind."""
        try:
            yield
        except Exception:
            self.abort()
            raise

    def _watch(self, module: torch.nn.Module, prefix: str, batch_dim: Optional[int], outputs: bool, cp_split: str,
               seq_dim: Optional[int]) -> None:
        if self._dp_ranks is not None and (placed := torch_adapter.place_tensor_parallel(module, self._dp_ranks)):
            self._place_again(*placed)
        adapter, module = _adapter_for(module, self.layout, self._dp_ranks, outputs, batch_dim)
        megatron = isinstance(adapter, megatron_adapter.MegatronAdapter)
        if megatron:
            self._bias_update = self._bias_update or expert_bias_update(module)
            for ddp in adapter.ddps:  # its scaling, the per-token loss's division (reducers.py)
                self._reducers.watch_megatron(ddp, lambda: self._step_now if self._writing else None)
        # megatron-core's DDP reduces in finalize_model_grads: read at the block's end, and again as its
        # optimizer steps, but for the distributed optimizer's, whose clip scales each rank's own shard
        # of the buffer in place: every rank's read would mix clipped and unclipped shards.
        if not (megatron and any(map(sharded, adapter.ddps))):
            self._reads.watch(module, self._optimizer_steps, outputs=not megatron)

        def named(path: str) -> str:
            path = adapter.name(path)
            return f"{prefix}.{path}" if prefix and path else prefix or path

        # Names add() would refuse (check_name) are refused now, not from a hook in the middle of the run.
        _check_names("parameter", (named(path) for path, _ in module.named_parameters()))
        for path, param in module.named_parameters():
            if adapter.dumps_param(path, param):
                self._watched.setdefault(named(path), (param, adapter))
        if outputs:
            self._hook_outputs(adapter, module, named, cp_split, seq_dim)

    def _hook_outputs(self, adapter: Adapter, module: torch.nn.Module, named: Callable[[str], str], cp_split: str,
                      seq_dim: Optional[int]) -> None:
        _check_names("module", (named(path) for path, _ in module.named_modules() if path))
        hooked = [sub for path, sub in module.named_modules() if path]
        if any(sub in self._hooked for sub in hooked):
            raise ValueError("watch(): this model, or a module in it, is watched already: its outputs would be "
                             "dumped twice")
        if cp_split not in CP_SPLITS:
            raise ValueError(f"cp_split must be one of {', '.join(CP_SPLITS)}, got {cp_split!r}")
        adapter.hook(self._hooks, Sink(live=lambda: self._writing, output=self._output, add=self.add, wants=self.wants,
                                       saw_rows=self._saw_rows, lost_rows=self._lost_rows), named, seq_dim)
        self._cp_split = cp_split
        self._hooked.update(hooked)

    def _place_again(self, coords: RankCoords, layout: Layout, dp_ranks: list[int]) -> None:
        """The ranks as a watched model under parallelize_module places them (TP over its mesh), where
        the Dumper had taken them all as DP ranks: before anything is recorded, which was placed so."""
        if (coords, layout) == (self.coords, self.layout):
            return
        if self.records or self.layout.tp > 1:
            raise ValueError("watch() a model under parallelize_module before add() or another model: what was "
                             f"recorded was placed as {self.layout.describe()}, the model's mesh makes it "
                             f"{layout.describe()}")
        self.coords, self.layout, self._dp_ranks = coords, layout, dp_ranks
        self._writer.coords, self._writer.layout = coords, layout

    def _saw_rows(self, rows: tuple[BatchRow, ...], packed: bool) -> None:
        self._packed |= packed
        self._row_log.saw(self._step_now, rows)
        self.cut_at(cp_split_bounds(rows[0], self._cp_split) if packed and rows else None)

    def cut_at(self, bounds: Optional[tuple[int, ...]]) -> None:
        """Where this rank's packed row is cut for CP's zigzag (its documents' bounds; None: the whole
        row is one sequence): where a stats-only record's sketch places its tokens in the whole. A
        watched model's forward call says so itself; a tensor split by tokens added before it (the
        batch's inputs) needs it said first."""
        self._writer.bounds = bounds

    def _lost_rows(self, reason: str, packed: bool) -> None:
        self._packed |= packed
        self._row_log.lose(reason)

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """A training step, written if `steps` chose it: when the block ends, the watched modules'
        parameter gradients are dumped (`.grad`, or megatron DDP's `main_grad`, gathered from every
        rank's shard under the distributed optimizer), with `params=True` the parameters too, and
        dump.json records `n`. A watched torch model's gradients are read when each backward's
        reduction completes instead, before any clip, and again as a torch optimizer steps on them
        (`name#stepped` where they differ: grad_reads.py), so a clip may stand inside the block or
        after it; a megatron-core model's are read again as its optimizer steps too, unless that
        optimizer is distributed. End the block before the optimizer step (megatron-core: after
        finalize_model_grads). A block that raises leaves its step out of the dump, with a warning
        (a loop that skips a step after an error goes on); steps do not nest."""
        n = _step_number(n)
        self._check_open("step")
        if self._step_now is not None:
            raise RuntimeError(f"step({n}) inside step({self._step_now}): steps do not nest")
        if n in self._steps:  # a step that raised is not: the loop may try it again
            raise RuntimeError(f"step({n}) ran already: its tensors would stand beside the first run's under one "
                               "step (a step counter that starts again, each epoch?)")
        outside, outside_step = self._writing, self._step_now
        self._writing, self._step_now = self._choice.wants(n), n
        # From the second step on, device statistics go through a Triton kernel: its compilation
        # (about a second a dtype) pays off over a training loop, not in a small run of one step
        # (megalign's own; a large one's takes it after stats.FUSED_AFTER elements).
        self._writer.summaries.fused = bool(self._steps)
        if self._writing:
            self._marks.append([n, len(self.records)])
        self._reads.begin_step()
        self._awaiting.clear()
        try:
            yield
        except BaseException as error:
            if self._writing:
                self._drop_step(n, error)
            raise
        else:
            if self._writing:
                if self._reads.watching:
                    self._reads.end_step()
                else:
                    self._dump_grads()
                self._dump_params()
                self._steps.append(n)
        finally:
            self._writing, self._step_now = outside, outside_step

    def _in_full(self, name: str) -> bool:
        """Whether `name`, written now, is one of dump_only's: under the step compare names it by, the
        last begun (the gradients read as the optimizer steps come after its block)."""
        return self._full is not None and self._full.wants(self._marks[-1][0] if self._marks else None, name)

    def _drop_step(self, n: int, error: BaseException) -> None:
        """Leave out step n, whose block raised: its records, its mark and its rows. Kept, its
        tensors would stand under the step before it in the dump (compare lines up records by step)."""
        first = self._marks.pop()[1]
        self._writer.discard_from(first)
        self._row_log.by_step.pop(n, None)
        with contextlib.suppress(Warning):  # warnings made errors must not replace the step's own error
            warnings.warn(f"megalign.Dumper: step {n} raised {type(error).__name__}: it is left out of the dump "
                          f"({len(self.records) - first} tensors)", stacklevel=4)

    def _check_open(self, call: str) -> None:
        self._check_process(call)
        if self._closed:
            raise RuntimeError(f"megalign.Dumper({str(self.out)!r}) is closed: what {call}() is given would be lost")

    def _check_process(self, call: str) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(f"megalign.Dumper({str(self.out)!r}) is process {self._pid}'s; {call}() in process "
                               f"{os.getpid()}, a fork of it, would mix into its dump or lose it (make a Dumper of "
                               "this process's own, with another out)")

    def _optimizer_steps(self) -> None:
        """A torch optimizer is about to step: after a written step's block, its gradients as the
        optimizer takes them (grad_reads.py), written under that step."""
        if self._step_now is None and self._reads.awaiting and not self._closed:
            self._reads.awaiting = False
            outside, self._writing = self._writing, True
            try:
                self._reads.stepped()
            finally:
                self._writing = outside

    def _held_grads(self) -> list[torch.Tensor]:
        return [grad for grad in (read_grad(param) for param, _ in self._watched.values()) if grad is not None]

    def _dump_params(self) -> None:
        """With `params`, the watched parameters (before the optimizer steps)."""
        for name, (param, adapter) in self._watched.items() if self._params else ():
            self.add(Kind.PARAM, name, param.detach(), adapter.param_sharding(name, param),
                     module=name.rpartition(".")[0] or None)

    def _dump_grads(self, suffix: str = "") -> range:
        """Each watched parameter's gradient, read where its adapter says, model by model (in the
        order watched: collectives in one order on every rank), named with `suffix`; the orders written."""
        first = len(self.records)
        by_adapter: dict[int, tuple[Adapter, dict[str, torch.nn.Parameter]]] = {}
        for name, (param, adapter) in self._watched.items():
            by_adapter.setdefault(id(adapter), (adapter, {}))[1][name] = param
        # An all-zero gradient is a missing one, unless the adapter says another rank vouches for it
        # (megatron's TP group: held_gradients, the worker's rule). A DTensor's test would be a
        # collective, and a piece may be zero on one rank only: never tested. Stats-only, each one's
        # statistics say so at close (a read-back now would stall a device's queue every step), but
        # not under megatron's TP: the TP ranks decide together, now.
        # A zoom's values have no statistics to say so at close: those are tested now, or a zoomed dump
        # would hold an all-zero gradient its stats-only counterpart leaves out.
        later = self._writer.stats_only and self.layout.tp == self.layout.expert_tp == 1
        for adapter, params in by_adapter.values():
            grads = adapter.read_grads(params)
            tested = {name for name, grad in grads.items() if grad is not None and not is_dtensor(grad)}
            now = {name for name in tested if not later or self._in_full(name + suffix)}
            held = adapter.held([grads[name] if name in now else None for name in grads],
                                list(params.values())) if now or not later else []
            present = {name: holds for name, holds in zip(grads, held) if name in now}
            for name, param in params.items():
                if grads[name] is not None and present.get(name, True):
                    self._record(Kind.PARAM_GRAD, name + suffix, grads[name], adapter.param_sharding(name, param),
                                 module=name.rpartition(".")[0] or None, unless_zero=name in tested - now)
        return range(first, len(self.records))

    def close(self, manifest: Optional[dict] = None, meta: Optional[Callable[[], dict]] = None) -> None:
        """Write every rank's manifest (with `manifest`'s extra fields), then (rank 0) dump.json, and
        rename the staging folder to `out`. `meta` makes dump.json's contents (a run's: stacks/meta.py's
        run_meta); None: a Python writer's, made from what was written. In a forked child: RuntimeError."""
        self._check_process("close")
        if self._closed:
            return
        self._stop_watching()
        if not self._choice.all and not self._steps:  # MEGALIGN_DUMP_STEPS=7 in a run of 3 steps
            warnings.warn(f"megalign.Dumper({str(self.out)!r}): none of the steps it was to dump ran "
                          f"(steps {self._choice}): the dump holds no step", stacklevel=2)
        self._writer.close({**(manifest or {}), "steps": self._marks} if self._marks else manifest)
        if self._world > 1:
            dist.barrier()  # every manifest is on disk before dump.json says the dump is complete
        self._row_logs = self._every_row_log()

        def land() -> None:
            try:
                write_json_atomic(self._folder / DUMP_META, (meta or self._meta)())
            except BaseException as error:  # no dump.json, no dump: the staging folder goes too
                self._landing.__exit__(type(error), error, error.__traceback__)
                raise
            self._landing.close()

        self._on_rank_zero(land)

    def _every_row_log(self) -> dict[int, RowLog]:
        """Each DP rank's rows, from its first TP and CP rank."""
        if self._world == 1:
            return {0: self._row_log}
        logs: list = [None] * self._world
        first = self.coords.tp_rank == 0 and self.coords.cp_rank == 0 and self.coords.pp_rank == 0
        dist.all_gather_object(logs, (self.coords.dp_rank, self._row_log) if first else None)
        return dict(filter(None, logs))

    def _meta(self) -> dict:
        kinds = {record.kind for record in self.records}
        rows = rows_meta(self._row_logs, self.layout.dp, self._packed, self._cp_split, self.layout.cp)
        return dump_meta("python", "backward" if kinds & {Kind.ACTIVATION_GRAD, Kind.PARAM_GRAD} else "forward",
                         self.layout, {"dtype": self._run_precision(), "stats_only": self._writer.stats_only,
                                       **({"dump_only": str(self._full)} if self._full else {}),
                                       "steps": self._steps, **rows, **self._reduction(),
                                       **({EXPERT_BIAS_UPDATE: self._bias_update} if self._bias_update else {})})

    def _reduction(self) -> dict:
        """dump.json's grad_reduction, where the run reduced gradients over ranks or the user said how."""
        reduction = self._reducers.reduction(self._stated_reduction, self.layout.dp)
        return {} if reduction is None else {REDUCTION: reduction.to_dict()}

    def _run_precision(self) -> str:
        """dump.json's dtype, the row of compare's thresholds: as stated (dtype=), else autocast's,
        else the widest float dtype recorded."""
        if self._precision is not None:
            return self._precision
        if self._autocast:  # its fp32 outputs and gradients carry the rounding of its bf16 matmuls
            return min(self._autocast, key=PRECISIONS.index)
        floats = list(filter(None, map(precision_name, {record.dtype for record in self.records})))
        # The widest: a bf16 mask beside fp32 activations must not loosen every tensor to bf16 (a 10%
        # error passed).
        return max(floats, key=PRECISIONS.index, default="fp32")

    def _stop_watching(self) -> None:
        """Closed: every hook off (outputs, gradient reads, the reducers' own), whatever comes next."""
        self._closed = True
        self._forget_unclosed()
        self._hooks.remove()
        self._reads.remove()
        self._reducers.release()

    def abort(self) -> None:
        """Stop without a dump: hooks off, the staging folder removed (rank 0). In a forked child,
        nothing: the dump is the parent's, and the error being handled is the one to report."""
        if self._closed or os.getpid() != self._pid:
            return
        self._stop_watching()
        with contextlib.suppress(Exception):  # the error being handled is the one to report
            self._writer.close()
        self._landing.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def _forget_unclosed(self) -> None:
        if self._unclosed is not None:
            self._unclosed.detach()

    def __enter__(self) -> "Dumper":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _output(self, kind: Kind, key: str, module: str, tensor: torch.Tensor, sharding: Sharding, view: View,
                grad_sharding: Optional[Sharding] = None) -> None:
        if self._writing:
            self.add_output(kind, key, tensor, sharding, view=view, module=module, grad_sharding=grad_sharding)

    def _on_rank_zero(self, action: Callable[[], None]) -> None:
        """Run `action` on rank 0, which owns the staging folder; every rank raises if it failed, so
        that no rank waits for a dump that will not come."""
        failure = None
        if self.coords.rank == 0:
            try:
                action()
            except Exception as error:
                failure = error
        if self._world > 1:
            message = _rank_zero_says(None if failure is None else str(failure))
            if failure is None and message is not None:
                raise UserError(f"rank 0: {message}")
        if failure is not None:
            raise failure


# A collective's tensors are released by gloo's worker thread after the caller has its result, and
# releasing a tensor Python made takes the GIL. Where that collective is the program's last (close()
# at the end of a script), the main thread may be finalizing the interpreter by then, and the worker
# thread dies holding C++ state: SIGABRT, "terminate called without an active exception" (seen after
# close() in an FSDP2 script, about one run in five under load; gdb shows ~AsyncBroadcastWork). So
# rank 0's message goes through a buffer of ours, and we wait until gloo has let go of it.
_MESSAGE_BYTES = 1024


def _rank_zero_says(message: Optional[str]) -> Optional[str]:
    """Rank 0's `message` (None: nothing to say) on every rank, cut to _MESSAGE_BYTES - 2 bytes."""
    buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=collective_device())
    if dist.get_rank() == 0 and message is not None:
        text = message.encode()[:_MESSAGE_BYTES - 2]
        buffer[0] = 1
        buffer[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else 0
    held = buffer._use_count()
    dist.broadcast(buffer, src=0)
    said = buffer.cpu()
    released = time.monotonic() + 1
    while buffer._use_count() > held and time.monotonic() < released:
        time.sleep(0.001)  # the GIL, free for gloo's thread to release its reference
    if not said[0]:
        return None
    return bytes(said[1:].tolist()).rstrip(b"\0").decode(errors="replace")


def _never_closed(out: str, landing: contextlib.ExitStack, pid: int) -> None:
    """A Dumper collected, or the program ending, before close() or abort(): said, and its staging
    folder removed (rank 0's landing holds it), by the process that made it (`pid`) only."""
    if os.getpid() != pid:  # a forked child's copy: the parent's dump goes on
        return
    # Said as from megalign itself: the frame at hand is the finalizer's, of no use to the reader.
    warnings.warn_explicit(f"megalign.Dumper({out!r}) was never closed: nothing was written (call close(), or use "
                           "the Dumper in a with block)", UserWarning, "megalign", 0)
    with contextlib.suppress(Exception):
        landing.__exit__(RuntimeError, RuntimeError("never closed"), None)


def _stated_precision(dtype: Union[str, torch.dtype], where: str = "dtype") -> str:
    """Dumper's `dtype=` as dump.json names a precision."""
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    precision = precision_name(name) if isinstance(name, str) else None
    if precision is None:
        raise ValueError(f"{where}: one of {', '.join(PRECISIONS)} or a torch float dtype, got {dtype!r}")
    return precision


def _flag(text: str, where: str) -> bool:
    if text not in ("0", "1", "true", "false"):
        raise ValueError(f"{where}: 0, 1, true or false, got {text!r}")
    return text in ("1", "true")


def _pattern(text: str, where: str) -> str:
    try:
        re.compile(text)
    except re.error as error:
        raise ValueError(f"{where}: not a regular expression ({error}): {text!r}") from None
    return text


# The environment's form of each Dumper keyword that has one (Dumper.from_env): variable -> (keyword,
# its reading of the text, which names the variable in a ValueError). claim and dp_group have none:
# a launcher's, and a process group.
ENVIRONMENT: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "MEGALIGN_DUMP_STEPS": ("steps", choose_steps),
    "MEGALIGN_OVERWRITE": ("overwrite", _flag),
    "MEGALIGN_STATS_ONLY": ("stats_only", _flag),
    "MEGALIGN_DUMP_ONLY": ("dump_only", full_values),
    "MEGALIGN_PARAMS": ("params", _flag),
    "MEGALIGN_FILTER": ("name_filter", _pattern),
    "MEGALIGN_DTYPE": ("dtype", _stated_precision),
    "MEGALIGN_GRAD_REDUCTION": ("grad_reduction", check_stated),
}


def _autocast_precision(tensor: torch.Tensor) -> Optional[str]:
    """The precision torch.autocast computes in, where `tensor` is recorded inside its block."""
    device = tensor.device.type  # on a device without autocast (meta), is_autocast_enabled raises
    if tensor.is_floating_point() and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return precision_name(dtype_name(torch.get_autocast_dtype(device)))
    return None


def _check_names(what: str, names: Iterable[str]) -> None:
    """ValueError for the first of a watched model's `names` (of a `what`: module, parameter) that
    reads as a repeat: its tensors would be refused by add() once the run is under way."""
    for name in names:
        if reason := check_name(name):
            raise ValueError(f"watch(): the {what} {reason}")


def _step_number(n) -> int:
    """A step's number: an int, or what stands for one (numpy's integers, a one-element integer tensor)."""
    try:
        if not isinstance(n, bool):
            return operator.index(n)
    except TypeError:
        pass
    raise TypeError(f"step(n): n is the step's number, got {n!r}")


class NullDumper:
    """What `Dumper.from_env()` gives with MEGALIGN_DUMP unset: the Dumper's methods, doing nothing,
    installing nothing (no hooks, no files)."""

    enabled = False
    records: list = []
    bytes_written = 0
    __slots__ = ()

    def wants(self, kind: str, name: str) -> bool:
        return False

    def add(self, *args, **kwargs) -> None:
        return None

    def add_output(self, *args, **kwargs) -> None:
        return None

    def watch(self, *args, **kwargs) -> None:
        return None

    def hook_outputs(self, *args, **kwargs) -> None:
        return None

    def cut_at(self, *args, **kwargs) -> None:
        return None

    def step(self, n: int) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def close(self, *args, **kwargs) -> None:
        return None

    def abort(self) -> None:
        return None

    def __enter__(self) -> "NullDumper":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        return None


def _place(dp_group: Union[dist.ProcessGroup, "DeviceMesh", None] = None
           ) -> tuple[RankCoords, Layout, Optional[list[int]]]:
    """This process's coordinates, the job's layout, and the ranks of this rank's DP group where the
    Dumper places them (None: megatron-core's parallel_state does, or a single process):
    parallel_state's where it is initialised (megatron_adapter.place), else torch.distributed's
    ranks as DP ranks over the world or `dp_group` (torch_adapter.place), else rank 0 of 1."""
    if not (dist.is_available() and dist.is_initialized()):
        if dp_group is not None:
            raise ValueError("dp_group is a process group of torch.distributed, which is not initialised")
        return RankCoords(rank=0), Layout(), None
    megatron = megatron_adapter.place()
    if megatron is None:
        return torch_adapter.place(dp_group)
    if dp_group is not None:
        raise ValueError("dp_group: megatron-core's parallel_state already places every rank")
    return (*megatron, None)


def _adapter_for(model: torch.nn.Module, layout: Layout, dp_ranks: Optional[list[int]], outputs: bool,
                 batch_dim: Optional[int]) -> tuple[Adapter, torch.nn.Module]:
    """The adapter of `model`'s framework, and the model it watches (a DDP's wrapped module)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        torch_adapter.check_ddp_group(model.process_group, dp_ranks)
        model = model.module  # plain .grad, all-reduced: replicas over the DP group
    megatron = megatron_adapter.adapter_for(model, layout)
    if megatron is not None:
        return megatron
    return torch_adapter.TorchAdapter(model, layout, outputs, batch_dim), model
