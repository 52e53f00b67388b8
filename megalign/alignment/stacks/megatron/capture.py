"""Forward hooks that dump every module's output, and tensor hooks that dump its gradient.

The sharding of a module output follows megatron-core's conventions: inside the model tensors are
sequence-first ([s, b, ...]); column-parallel linears and the core attention leave their last dim
split over TP ranks; row-parallel linears all-reduce, so their outputs are replicas.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

from megalign.alignment.spec import ModelConfig
from megalign.alignment.dump.writer import RankWriter
from megalign.alignment.stacks.megatron.model import global_name, layer_index, logits_layout
from megalign.alignment.dump.sharding import Sharding

_TP_LAST_DIM = ("ColumnParallel", "DotProductAttention", "ZigzagCPAttention")
_QK_NORMS = ("q_layernorm", "k_layernorm")
LOGITS_MODULE = "output_layer"
INPUT_CAPTURED = ".mlp.linear_fc2"  # modules whose input is dumped too, as `<name>#input`  # its first output is the logits, [s, b, vocab/tp]


def output_sharding(module: torch.nn.Module, name: str, index: int, tensor: torch.Tensor, local_seq: int,
                    model_config: ModelConfig) -> Sharding:
    # Sequence-first everywhere but the word embedding lookup, which is still [b, s, h].
    seq_dim = 1 if isinstance(module, VocabParallelEmbedding) else 0
    if tensor.ndim <= seq_dim or tensor.shape[seq_dim] != local_seq:
        seq_dim = None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return Sharding(seq_dim=seq_dim)
    kind = type(module).__name__
    leaf = name.rsplit(".", 1)[-1]
    tp_dim, parts = None, 1
    if any(k in kind for k in _TP_LAST_DIM) and not getattr(module, "gather_output", False):
        # Index 1 of a column-parallel linear is its (skipped) bias: a shard with no sequence dim.
        tp_dim = tensor.ndim - 1
        parts = 2 if model_config.swiglu and leaf == "linear_fc1" else 1
    elif leaf in _QK_NORMS:
        tp_dim = tensor.ndim - 2  # [s, b, heads/tp, head_dim]
    elif ".core_attention." in name:
        tp_dim = tensor.ndim - 3  # softmax and dropout inside the attention: [b, heads/tp, sq, sk]
    return Sharding(seq_dim=seq_dim, tp_dim=tp_dim, tp_parts=parts)


class ActivationCapture:
    """Registers hooks on every submodule of `model`; `remove()` takes them off again."""

    def __init__(self, model: torch.nn.Module, writer: RankWriter, model_config: ModelConfig, local_seq: int,
                 grads: bool):
        self.writer, self.model_config, self.local_seq, self.grads = writer, model_config, local_seq, grads
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.handles = []
        for local, module in model.named_modules():
            if not local or isinstance(module, (IdentityOp, IdentityFuncOp)):
                continue  # the root's output is the loss (dumped by the loss function); identities add nothing
            if local == "decoder" and not self.last_stage:
                continue  # on earlier PP stages the block's output is just its last layer's output
            if local == "rotary_pos_emb" and not parallel_state.is_pipeline_first_stage():
                continue  # every stage computes the same table; the first one dumps it
            name = global_name(model, local)
            self.handles.append(module.register_forward_hook(self._hook(name)))
            if local.endswith(INPUT_CAPTURED):
                self.handles.append(module.register_forward_pre_hook(self._input_hook(name)))

    def _hook(self, name: str):
        def record(module, inputs, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for index, tensor in enumerate(outputs):
                if not isinstance(tensor, torch.Tensor):
                    continue
                sharding = output_sharding(module, name, index, tensor, self.local_seq, self.model_config)
                kind, key, view = "activation", name if index == 0 else f"{name}#{index}", None
                if key == LOGITS_MODULE:
                    # Logits are dumped batch-first, [b, s, vocab], the way every stack can write them.
                    kind, key = "logits", "logits"
                    sharding, view = logits_layout(self.model_config, sharding)
                self._record(kind, key, name, tensor, sharding, view)

        return record

    def _input_hook(self, name: str):
        """The down projection's input: SwiGLU's output, a bare function with no module of its own.
        A row-parallel linear's input has its last dim split over TP ranks."""
        def record(module, inputs):
            tensor = inputs[0]
            tp_dim = tensor.ndim - 1 if parallel_state.get_tensor_model_parallel_world_size() > 1 else None
            seq_dim = 0 if tensor.ndim > 0 and tensor.shape[0] == self.local_seq else None
            self._record("activation", f"{name}#input", name, tensor, Sharding(seq_dim=seq_dim, tp_dim=tp_dim))

        return record

    def _record(self, kind: str, key: str, name: str, tensor: torch.Tensor, sharding: Sharding, view=None) -> None:
        """Dump `tensor` (through `view`, if any) now and its gradient when backward reaches it."""
        view = view or (lambda t: t)
        layer = layer_index(name)
        if self.writer.wants(kind, key):
            self.writer.add(kind, key, view(tensor), sharding, module=name, layer=layer)
        if self.grads and tensor.requires_grad and self.writer.wants("activation_grad", key):
            def on_grad(grad: Optional[torch.Tensor]):
                if grad is not None:
                    self.writer.add("activation_grad", key, view(grad), sharding, module=name, layer=layer)

            tensor.register_hook(on_grad)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
