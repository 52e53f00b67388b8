"""Forward hooks that dump every module's output, and tensor hooks that dump its gradient, each
through megalign.Dumper's `add` with the sharding inferred here.

The sharding of a module output follows megatron-core's conventions: inside the model tensors are
sequence-first ([s, b, ...]); column-parallel linears and the core attention leave their last dim
split over TP ranks; row-parallel linears all-reduce, so their outputs are replicas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megalign.dump.megatron_params import gated_linear
from megalign.dump.sharding import Sharding
from megalign.dump.dumper import Dumper
from megalign.spec import ModelConfig
from megalign.stacks.megatron.model import global_name, logits_layout

_TP_LAST_DIM = ("ColumnParallel", "DotProductAttention", "ZigzagCPAttention")  # and megatron's core_attention
_QK_NORMS = ("q_layernorm", "k_layernorm")
LOGITS_MODULE = "output_layer"  # its first output is the logits, [s, b, vocab/tp]
INPUT_CAPTURED = ".mlp.linear_fc2"  # modules whose input is dumped too, as `<name>#input`
# Inside an MoE layer the experts see permuted tokens, as many as were routed to each: no sequence
# layout to reassemble. The router's decisions are dumped instead (kind `routing`), and the layer's output.
_EXPERTS = re.compile(r"\.mlp\.experts(\.|$)")


@dataclass(frozen=True)
class LocalShape:
    """What one rank's tensors look like: its tokens per sequence (after the CP split), its sequences
    (after the DP split), and whether sequence parallelism splits the tokens again over the TP ranks."""

    seq: int
    batch: int
    tp: int
    sp: bool

    def seq_sharding(self, tensor: torch.Tensor, seq_dim: int, batch_dim: Optional[int]) -> Sharding:
        """The sequence and batch sharding of a tensor laid out with its tokens on `seq_dim`."""
        length = tensor.shape[seq_dim] if tensor.ndim > seq_dim else None
        sp = self.sp and length == self.seq // self.tp
        if length != self.seq and not sp:
            return Sharding()
        dp_dim = batch_dim if batch_dim is not None and tensor.shape[batch_dim] == self.batch else None
        return Sharding(seq_dim=seq_dim, sp=sp, dp_dim=dp_dim)


def output_sharding(module: torch.nn.Module, name: str, tensor: torch.Tensor, local: LocalShape,
                    model_config: ModelConfig) -> Sharding:
    if name == "rotary_pos_emb":
        return local.seq_sharding(tensor, 0, None)  # [s, 1, 1, dim]: no batch
    if ".core_attention." in name and tensor.ndim == 4:
        # softmax and dropout inside the attention: [b, heads/tp, sq, sk], the sequence never split by SP
        sharding = Sharding(dp_dim=0 if tensor.shape[0] == local.batch else None)
        return replace(sharding, tp_dim=1) if local.tp > 1 else sharding
    sharding = local.seq_sharding(tensor, 0, 1)  # sequence-first: [s, b, ...]
    if local.tp == 1 or sharding.sp:
        return sharding
    kind = type(module).__name__
    leaf = name.rsplit(".", 1)[-1]
    if any(k in kind for k in _TP_LAST_DIM) and not getattr(module, "gather_output", False):
        # Index 1 of a column-parallel linear is its (skipped) bias: a shard with no sequence dim.
        parts = 2 if model_config.swiglu and gated_linear(leaf) else 1
        return replace(sharding, tp_dim=tensor.ndim - 1, tp_parts=parts)
    if leaf in _QK_NORMS:
        return replace(sharding, tp_dim=tensor.ndim - 2)  # [s, b, heads/tp, head_dim]
    return sharding


def _replayed(router: TopKRouter) -> Optional[torch.Tensor]:
    """The expert ids megatron's router replay forced on this router, if any."""
    replay = getattr(router, "router_replay", None)
    if replay is None or replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
        return None
    return replay.target_topk_idx


class ActivationCapture:
    """Registers hooks on every submodule of `model`; `remove()` takes them off again."""

    def __init__(self, model: torch.nn.Module, dumper: Dumper, model_config: ModelConfig, local: LocalShape,
                 grads: bool):
        self.dumper, self.model_config, self.local, self.grads = dumper, model_config, local, grads
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.handles, self.routers = [], []
        for local, module in model.named_modules():
            if not local or isinstance(module, (IdentityOp, IdentityFuncOp)):
                continue  # the root's output is the loss (dumped by the loss function); identities add nothing
            if local == "decoder" and not self.last_stage:
                continue  # on earlier PP stages the block's output is just its last layer's output
            if local == "rotary_pos_emb" and not parallel_state.is_pipeline_first_stage():
                continue  # every stage computes the same table; the first one dumps it
            name = global_name(model, local)
            if _EXPERTS.search(name):
                continue
            if isinstance(module, TopKRouter):
                self._trace_router(module, name)
                continue
            self.handles.append(module.register_forward_hook(self._hook(name)))
            if local.endswith(INPUT_CAPTURED):
                self.handles.append(module.register_forward_pre_hook(self._input_hook(name)))

    def _hook(self, name: str):
        def record(module, inputs, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for index, tensor in enumerate(outputs):
                if not isinstance(tensor, torch.Tensor):
                    continue
                kind, key, view = "activation", name if index == 0 else f"{name}#{index}", None
                if isinstance(module, VocabParallelEmbedding):
                    # The lookup is [b, s, h], or [s/tp, b, h] where SP reduce-scatters it: dumped batch-first.
                    sequence_first = getattr(module, "reduce_scatter_embeddings", False)
                    view = (lambda t: t.transpose(0, 1)) if sequence_first else None
                    sharding = self.local.seq_sharding(view(tensor) if view else tensor, 1, 0)
                else:
                    sharding = output_sharding(module, name, tensor, self.local, self.model_config)
                if key == LOGITS_MODULE:
                    # Logits are dumped batch-first, [b, s, vocab], the way every stack can write them.
                    kind, key = "logits", "logits"
                    sharding, view = logits_layout(self.model_config, sharding)
                self._record(kind, key, name, tensor, sharding, view)

        return record

    def _trace_router(self, router: TopKRouter, name: str) -> None:
        """Per MoE layer: the router logits [s, b, experts] (what megatron's gating returns), and the
        experts chosen for each token with their weights, [s, b, topk], highest weight first."""
        gating = router.gating

        def traced_gating(hidden):
            logits = gating(hidden)
            self._record_routing(f"{name}.logits", name, logits)
            return logits

        def record(module, inputs, output):
            probs, chosen = output  # [tokens, experts], tokens in [s, b] order; zero where not chosen
            tokens = inputs[0].shape[:2]
            forced = _replayed(module)
            if forced is not None:  # replayed choices in their recorded order: bf16 weights may tie
                experts = forced.to(probs.device)
                weights = probs.detach().gather(1, experts)
            else:
                weights, experts = probs.detach().masked_fill(~chosen, float("-inf")).topk(module.topk, dim=-1)
            self._record_routing(f"{name}.experts", name, experts.view(*tokens, -1))
            self._record_routing(f"{name}.weights", name, weights.view(*tokens, -1))

        router.gating = traced_gating  # an instance attribute, taken off again by remove()
        self.routers.append(router)
        self.handles.append(router.register_forward_hook(record))

    def _record_routing(self, key: str, module: str, tensor: torch.Tensor) -> None:
        if self.dumper.wants("routing", key):
            self.dumper.add("routing", key, tensor.detach(), self.local.seq_sharding(tensor, 0, 1), module=module)

    def _input_hook(self, name: str):
        """The down projection's input: SwiGLU's output, a bare function with no module of its own.
        A row-parallel linear's input has its last dim split over TP ranks."""
        def record(module, inputs):
            tensor = inputs[0]
            sharding = self.local.seq_sharding(tensor, 0, 1)
            if self.local.tp > 1:
                sharding = replace(sharding, tp_dim=tensor.ndim - 1)
            self._record("activation", f"{name}#input", name, tensor, sharding)

        return record

    def _record(self, kind: str, key: str, name: str, tensor: torch.Tensor, sharding: Sharding, view=None) -> None:
        """Dump `tensor` (through `view`, if any) now and its gradient when backward reaches it."""
        view = view or (lambda t: t)
        if self.dumper.wants(kind, key):
            self.dumper.add(kind, key, view(tensor), sharding, module=name)
        if self.grads and tensor.requires_grad and self.dumper.wants("activation_grad", key):
            def on_grad(grad: Optional[torch.Tensor]):
                if grad is not None:
                    self.dumper.add("activation_grad", key, view(grad), sharding, module=name)

            tensor.register_hook(on_grad)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for router in self.routers:
            del router.gating
