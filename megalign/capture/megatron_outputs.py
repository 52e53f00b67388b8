"""How a megatron-core module's output lies on one rank: which dim holds the sequence (split over CP
ranks, and again over the TP ranks under sequence parallelism), which the batch (split over DP
ranks), which is split over TP ranks. Stated once, for megalign's megatron worker
(through capture/megatron_hooks.py) and for `Dumper.watch` on a user's megatron-core model alike.

megatron-core's conventions: inside the model tensors are sequence-first ([s, b, ...]);
column-parallel linears and the core attention leave their last dim split over TP ranks;
row-parallel linears all-reduce (under SP: reduce-scatter the sequence), so their outputs are
replicas (or SP pieces). Read from class names and attributes only, so that the Dumper imports no megatron.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

import torch

from megalign.capture.adapter import View
from megalign.dump.layout import BatchRow
from megalign.dump.megatron_params import gated_linear
from megalign.dump.sharding import Sharding

_TP_LAST_DIM = ("ColumnParallel", "DotProductAttention", "ZigzagCPAttention")  # and megatron's core_attention
_QK_NORMS = ("q_layernorm", "k_layernorm")
_IDENTITIES = ("IdentityOp", "IdentityFuncOp")  # their input again, or a function: nothing to add
INPUT_CAPTURED = ".mlp.linear_fc2"  # modules whose input is dumped too, as `<name>#input`
# Inside an MoE layer the experts see permuted tokens, as many as were routed to each, and the router
# gives [tokens, experts]: no sequence layout to reassemble (the router's decisions are dumped
# instead, as kind routing: routing_choices).
_EXPERTS = re.compile(r"\.mlp\.experts(\.|$)")


@dataclass(frozen=True)
class LocalShape:
    """What one rank's tensors look like: its tokens per sequence (after the CP split), its sequences
    (after the DP split), whether sequence parallelism splits the tokens again over the TP ranks, and
    whether the MLP's first linear fuses SwiGLU's gate|up (each TP rank holds a slice of both)."""

    seq: int
    batch: int
    tp: int
    sp: bool
    swiglu: bool = False

    @classmethod
    def of_model(cls, config, tokens: torch.Tensor, tp: int) -> "LocalShape":
        """A megatron-core model's, from its TransformerConfig and this rank's tokens [b, s]."""
        return cls(seq=tokens.shape[1], batch=tokens.shape[0], tp=tp, sp=bool(config.sequence_parallel),
                   swiglu=bool(config.gated_linear_unit))

    def seq_sharding(self, tensor: torch.Tensor, seq_dim: int, batch_dim: Optional[int]) -> Sharding:
        """The sequence and batch sharding of a tensor laid out with its tokens on `seq_dim`."""
        length = tensor.shape[seq_dim] if tensor.ndim > seq_dim else None
        sp = self.sp and length == self.seq // self.tp
        if length != self.seq and not sp:
            return Sharding()
        dp_dim = batch_dim if batch_dim is not None and tensor.shape[batch_dim] == self.batch else None
        return Sharding(seq_dim=seq_dim, sp=sp, dp_dim=dp_dim)


def packed_row(params) -> BatchRow:
    """A packed (THD) row from megatron-core's PackedSeqParams: documents start at cu_seqlens_q_padded
    (cu_seqlens_q where the documents are not padded) and hold cu_seqlens_q's real tokens."""
    real = params.cu_seqlens_q.flatten().tolist()
    padded = real if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded.flatten().tolist()
    return BatchRow(bounds=tuple(padded), lengths=tuple(end - start for start, end in zip(real[:-1], real[1:])))


def is_megatron_model(module: torch.nn.Module) -> bool:
    """A megatron-core model (GPTModel and its kin): its TransformerConfig says how it is split."""
    config = getattr(module, "config", None)
    return hasattr(config, "sequence_parallel") and hasattr(config, "context_parallel_size")


def without_layout(name: str, module: torch.nn.Module) -> bool:
    """Outputs with no sequence layout to put back together: identities, an MoE layer's router and experts."""
    kind = type(module).__name__
    return kind in _IDENTITIES or is_router(module) or bool(_EXPERTS.search(name))


def is_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Router")


def routing_choices(router: torch.nn.Module, inputs: tuple, output: tuple,
                    forced: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """A router's decisions from its forward call, as kind routing records them: the experts chosen
    for each token, highest weight first, and their weights, [s, b, topk] like its input [s, b, h]
    (every rank's experts over all of them: no EP split). `forced`: the expert ids a replay imposed, in
    their recorded order (bf16 weights may tie)."""
    probs, chosen = output  # [tokens, experts], tokens in [s, b] order; zero where not chosen
    if forced is not None:
        experts = forced.to(probs.device)
        weights = probs.detach().gather(1, experts)
    else:
        weights, experts = probs.detach().masked_fill(~chosen, float("-inf")).topk(router.topk, dim=-1)
    tokens = inputs[0].shape[:2]
    return {"experts": experts.view(*tokens, -1), "weights": weights.view(*tokens, -1)}


def output_sharding(module: torch.nn.Module, name: str, tensor: torch.Tensor, local: LocalShape) -> tuple[Sharding, View]:
    """The sharding of `tensor`, an output of `module` (named `name`), and the view it is dumped
    through: the word embeddings' lookup is dumped batch-first, [b, s, h], the way SP leaves it or not."""
    if type(module).__name__ == "VocabParallelEmbedding":
        # The lookup is [b, s, h], or [s/tp, b, h] where SP reduce-scatters it.
        view = (lambda t: t.transpose(0, 1)) if getattr(module, "reduce_scatter_embeddings", False) else None
        return local.seq_sharding(view(tensor) if view else tensor, 1, 0), view
    return _sequence_first_sharding(module, name, tensor, local), None


def _sequence_first_sharding(module: torch.nn.Module, name: str, tensor: torch.Tensor, local: LocalShape) -> Sharding:
    if name.split(".")[-1] == "rotary_pos_emb":  # the model's, or MLA's own in each attention
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
        parts = 2 if local.swiglu and gated_linear(leaf) else 1
        return replace(sharding, tp_dim=tensor.ndim - 1, tp_parts=parts)
    if leaf in _QK_NORMS:
        return replace(sharding, tp_dim=tensor.ndim - 2)  # [s, b, heads/tp, head_dim]
    return sharding


def input_sharding(tensor: torch.Tensor, local: LocalShape) -> Sharding:
    """The input of INPUT_CAPTURED's down projection (SwiGLU's output, a bare function with no module
    of its own): a row-parallel linear's input has its last dim split over TP ranks."""
    sharding = local.seq_sharding(tensor, 0, 1)
    return replace(sharding, tp_dim=tensor.ndim - 1) if local.tp > 1 else sharding
