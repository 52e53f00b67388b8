"""megatron-core's adapter: a GPTModel (or its kin, or megatron-core's DDP around one) as the Dumper
writes it, and the rules megalign's megatron worker writes its dumps by (stacks/megatron), stated
once here: the ranks' places from parallel_state, global layer and expert names under PP and EP
(megatron_names.py), output sharding (megatron_outputs.py, walked by megatron_hooks.py), parameter
sharding with expert TP, gradients read from DDP or the distributed optimizer with the TP-group
rule of whether a rank holds one (ddp_grads.py), how DDP reduces them (GradScaling), the router's
decisions (megatron_router.py), and the padded vocabulary. What megalign's worker dumps beyond a
user's model is an option of the same adapter (WorkerOutputs): the worker captures through it, as
`Dumper.watch` does. Duck-typed and read through parallel_state where the program imported it: no
megatron import."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megalign.capture.adapter import Sink
from megalign.capture.coverage import read_grad
from megalign.capture.ddp_grads import (find_megatron_ddp, gathered_grads, held_gradients, is_megatron_ddp,
                                        megatron_state, shard_grads, sharded, tp_group)
from megalign.capture.hooks import Hooks
from megalign.capture.megatron_hooks import hook_megatron_model
from megalign.capture.megatron_names import global_name, is_duplicate_embedding
from megalign.capture.megatron_outputs import LocalShape, is_megatron_model, packed_row
from megalign.capture.megatron_router import router_tracer
from megalign.dump.format import Kind, RankCoords
from megalign.dump.grad_convention import GradReduction, mean_of
from megalign.dump.layout import Layout
from megalign.dump.megatron_params import gated_linear, split_by_name_only
from megalign.dump.sharding import Sharding
from megalign.spec import VOCAB_PARAMS


def place() -> Optional[tuple[RankCoords, Layout]]:
    """This rank's coordinates and the job's layout, from parallel_state; None where the program
    did not initialise it."""
    state = megatron_state()
    if state is None:
        return None
    coords = RankCoords(rank=dist.get_rank(), tp_rank=state.get_tensor_model_parallel_rank(),
                        cp_rank=state.get_context_parallel_rank(), pp_rank=state.get_pipeline_model_parallel_rank(),
                        dp_rank=state.get_data_parallel_rank())
    return coords, Layout(tp=state.get_tensor_model_parallel_world_size(),
                          pp=state.get_pipeline_model_parallel_world_size(),
                          cp=state.get_context_parallel_world_size(), dp=state.get_data_parallel_world_size(),
                          ep=state.get_expert_model_parallel_world_size(),
                          etp=state.get_expert_tensor_parallel_world_size())


def param_sharding(name: str, param: torch.nn.Parameter, swiglu: bool) -> Sharding:
    """megatron-core marks a TP-split parameter `tensor_model_parallel`, split on `partition_dim`; an
    expert's (`allreduce` False) over the expert TP ranks, which are the TP ranks or (ETP=1) none
    (tp_group). Under SwiGLU, linear_fc1 (its weight and bias) holds gate|up fused, each rank a slice
    of both: told by the name, as megatron's own checkpoints tell it (`partition_stride` is not set
    by every linear: kitchen's keeps 1). Unmarked, a parameter is a replica, but for the few that the
    name says megatron splits all the same (megatron_params.split_by_name_only)."""
    if tp_group(param) is None:
        return Sharding()
    if getattr(param, "tensor_model_parallel", False):
        return Sharding(tp_dim=param.partition_dim, tp_parts=2 if swiglu and gated_linear(name) else 1)
    return Sharding(tp_dim=split_by_name_only(name))


def read_grads(ddps: Iterable[torch.nn.Module], params: dict[str, torch.nn.Parameter],
               source: str = "auto") -> dict[str, Optional[torch.Tensor]]:
    """Each parameter's gradient where megatron-core leaves it: gathered from every rank's shard of
    its bucket where the distributed optimizer reduces only a shard (a collective over each DDP's
    DP*CP group, every bucket, watched or not), else `.grad` or DDP's `main_grad` (coverage.read_grad).
    `source` (megalign's --grad-source): "grad" reads only `.grad` (None under DDP), "main_grad" only
    `main_grad`, "shard" this rank's own shard under the distributed optimizer (None for a parameter
    not wholly in it): the classic mistakes, kept reachable."""
    found: dict[int, Optional[torch.Tensor]] = {}
    if source != "grad":
        for ddp in ddps:
            if sharded(ddp):
                found.update((id(param), grad) for param, grad in
                              (shard_grads(ddp) if source == "shard" else gathered_grads(ddp)))
    return {name: found[id(param)] if id(param) in found else read_grad(param, source)
            for name, param in params.items()}


def vocab_view(vocab_size: int, padded_size: int, dim: int) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """A vocabulary-parallel tensor cut back to the real vocabulary where megatron pads it to a
    multiple of TP (None: not padded): gathered over the TP ranks, since uneven shards would not put
    back together, so the result is whole, a replica on every TP rank (its sharding: none)."""
    if padded_size == vocab_size:
        return None
    return lambda shard: _real_vocab(shard, vocab_size, dim)


def logits_layout(sharding: Sharding, vocab_size: int, padded_size: int) -> tuple[Sharding, Callable]:
    """How the output layer's logits [s, b, vocab/tp] are dumped: batch-first [b, s, vocab], cut back
    to the real vocabulary where it is padded. Returns (sharding, view)."""
    batch_first = Sharding(seq_dim=1, dp_dim=0 if sharding.dp_dim is not None else None)
    real = vocab_view(vocab_size, padded_size, dim=-1)
    if real is None:
        return replace(batch_first, tp_dim=sharding.tp_dim), lambda t: t.transpose(0, 1)
    return batch_first, lambda t: real(t).transpose(0, 1)


def param_grad_layout(name: str, grad: torch.Tensor, sharding: Sharding, vocab_size: int,
                      padded_size: int) -> tuple[torch.Tensor, Sharding]:
    """A parameter gradient as dumped: the vocabulary parameters' padded rows cut off."""
    real = vocab_view(vocab_size, padded_size, dim=0) if name in VOCAB_PARAMS else None
    return (grad, sharding) if real is None else (real(grad), Sharding())


def mask_vocab_padding(vocab_size: int) -> Callable:
    """A forward hook on the output layer: padded vocabulary entries get -inf logits, so that the
    softmax (and the loss) sees only the real vocabulary."""
    def hook(module, inputs, output):
        logits, bias = output
        shard = logits.shape[-1]
        first = megatron_state().get_tensor_model_parallel_rank() * shard
        padding = torch.arange(first, first + shard, device=logits.device) >= vocab_size
        return logits.masked_fill(padding, float("-inf")), bias

    return hook


def _real_vocab(shard: torch.Tensor, vocab_size: int, dim: int) -> torch.Tensor:
    state = megatron_state()
    shards = [torch.empty_like(shard) for _ in range(state.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, shard.detach().contiguous(), group=state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=dim).narrow(dim, 0, vocab_size)


class GradScaling:
    """How a megatron-core DDP (megatron-core 0.18) reduces gradients, for reducers.py: it scales each
    buffer's gradients by its `gradient_scaling_factor` before the collective, which averages over
    the buffer's group where `average_in_collective`: at its defaults 1/(DP x CP) then a sum, a mean.
    With `calculate_per_token_loss` it sums, and megatron's schedule hands the step's token count to
    finalize_model_grads, which divides by it through `scale_gradients`: its factors are kept in each
    step `step_now()` names (None: a step not dumped), until `release()`."""

    def __init__(self, ddp: torch.nn.Module, step_now: Callable[[], Optional[int]]):
        self._ddp = weakref.ref(ddp)
        self._scales: dict[int, list[torch.Tensor]] = {}
        scale = ddp.scale_gradients

        def scale_gradients(factor) -> None:
            if (step := step_now()) is not None:  # kept on its device: no read-back mid-step
                self._scales.setdefault(step, []).append(torch.as_tensor(factor).detach().clone())
            scale(factor)

        ddp.scale_gradients = scale_gradients

    def of(self, ddp: torch.nn.Module) -> bool:
        return self._ddp() is ddp

    def release(self) -> None:
        """The DDP's scale_gradients as it was."""
        if (ddp := self._ddp()) is not None:
            ddp.__dict__.pop("scale_gradients", None)

    def reduction(self) -> Optional[GradReduction]:
        """The DDP's divisor (None: the DDP is gone): of every buffer, 1/its scaling factor, times its
        group's size where the collective averages (one for all of them, else unknown); per step, over
        the factors scale_gradients was given."""
        if (ddp := self._ddp()) is None:
            return None
        average = ddp.ddp_config.average_in_collective
        divisors = {(b.data_parallel_world_size if average else 1) / b.gradient_scaling_factor
                    for b in ddp.buffers + ddp.expert_parallel_buffers}
        if len(divisors) != 1:
            return GradReduction(None, "megatron DDP, buffers of different scaling factors")
        base = round(divisors.pop(), 9)  # 1 / (1/3) is 3.0000000000000004
        if not self._scales:
            how = "summed" if base == 1 else mean_of(int(base)) if base.is_integer() else f"scaled by 1/{base:g}"
            return GradReduction(float(base), f"megatron DDP, {how}")
        # A factor is 1/tokens in the gradients' dtype (float32: 1/19 reads back as 1/18.9999998)
        per_step = tuple((step, float(f"{base / math.prod(float(f) for f in factors):.7g}"))
                         for step, factors in sorted(self._scales.items()))
        return GradReduction(float(base), "megatron DDP, per-token loss", per_step)


LOGITS_MODULE = "output_layer"  # its first output is the logits, [s, b, vocab/tp]


@dataclass(frozen=True)
class WorkerOutputs:
    """What megalign's megatron worker dumps beyond a user's model's outputs, as its dumps have
    always held them: the logits as their own kind (logits_layout: batch-first, the real vocabulary
    of `vocab_size`, padded to `padded_vocab_size`), each router's logits beside its choices, and the
    RoPE table of packed rows too (a replica on each rank)."""

    vocab_size: int
    padded_vocab_size: int


def adapter_for(model: torch.nn.Module, layout: Layout) -> Optional[tuple["MegatronAdapter", torch.nn.Module]]:
    """megatron-core's adapter and the model it watches (megatron DDP's wrapped module), where
    `model` is megatron-core's; None where it is not."""
    if is_megatron_ddp(model):
        return MegatronAdapter(model.module, [model], layout), model.module
    if not is_megatron_model(model):
        return None
    return MegatronAdapter(model, list(filter(None, [find_megatron_ddp(model)])), layout), model


class MegatronAdapter:
    """A megatron-core model as the Dumper writes it (capture/adapter.py's Adapter). `ddps`: the
    megatron DDPs around it, where its gradients are read; `worker`: megalign's worker's own outputs."""

    def __init__(self, model: torch.nn.Module, ddps: list[torch.nn.Module], layout: Layout,
                 worker: Optional[WorkerOutputs] = None):
        if layout.pp > 1 and not hasattr(model, "decoder"):
            # Global layer names are read from the model's decoder: a part of it (its TransformerBlock)
            # would dump every stage's first layer under one name.
            raise NotImplementedError("watch() of a part of a megatron-core model split over PP stages: watch the "
                                      "model (GPTModel, or megatron-core's DDP around it)")
        self.model, self.ddps, self.layout, self.worker = model, ddps, layout, worker

    def name(self, path: str) -> str:
        return global_name(self.model, path)

    def dumps_param(self, name: str, param: torch.nn.Parameter) -> bool:
        return not is_duplicate_embedding(name, param)

    def param_sharding(self, name: str, param: torch.nn.Parameter) -> Sharding:
        return param_sharding(name, param, bool(self.model.config.gated_linear_unit))

    def read_grads(self, params: dict[str, torch.nn.Parameter]) -> dict[str, Optional[torch.Tensor]]:
        return read_grads(self.ddps, params)

    def held(self, grads: list[Optional[torch.Tensor]], params: list[torch.nn.Parameter]) -> list[bool]:
        return held_gradients(grads, params)

    def hook(self, hooks: Hooks, sink: Sink, named: Callable[[str], str], seq_dim: Optional[int]) -> None:
        """Every module's output, laid out as megalign's worker lays it out, from the TransformerConfig
        and each call's input_ids [b, s] (this rank's share of the batch) and packed_seq_params (its
        packed row, recorded); a router's decisions as kind routing; with `worker`, its outputs too."""
        if seq_dim is not None:
            raise ValueError("seq_dim names the token dim beside batch_dim, of a model other than megatron-core's "
                             "(whose layout is known)")
        local: list[LocalShape] = []
        packed = [False]

        def learn(root, args, kwargs) -> None:
            tokens = args[0] if args else kwargs["input_ids"]
            local[:] = [LocalShape.of_model(self.model.config, tokens, self.layout.tp)]
            params = kwargs.get("packed_seq_params")
            packed[0] = params is not None
            if packed[0] and sink.live():
                row = packed_row(params)
                if tokens.shape[0] != 1 or tokens.shape[1] * self.layout.cp != row.bounds[-1]:
                    sink.lost_rows(f"input_ids {list(tokens.shape)} on each of {self.layout.cp} CP ranks is not one "
                                   f"packed row of the {row.bounds[-1]} tokens cu_seqlens_q_padded ends at", True)
                else:
                    sink.saw_rows((row,), True)

        hooks.before_call(self.model, learn)
        worker, logits = self.worker, named(LOGITS_MODULE)

        def output(key: str, name: str, tensor: torch.Tensor, sharding: Sharding, view) -> None:
            if worker is not None and key == logits:
                # Logits are dumped batch-first, [b, s, vocab], the way every stack can write them.
                sharding, view = logits_layout(sharding, worker.vocab_size, worker.padded_vocab_size)
                sink.output(Kind.LOGITS, "logits", name, tensor, sharding, view, None)
            else:
                sink.output(Kind.ACTIVATION, key, name, tensor, sharding, view, None)

        # The worker's packed runs keep the RoPE table (WorkerOutputs): their dumps have always held it.
        hook_megatron_model(hooks, self.model, output, lambda: local[0], named=named, live=sink.live,
                            packed=lambda: packed[0] and worker is None,
                            router=router_tracer(hooks, sink, lambda: local[0], logits=worker is not None))
