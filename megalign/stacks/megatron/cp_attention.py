"""A pure-torch causal core attention that works under context parallelism and on packed rows.

megatron-core's local DotProductAttention refuses context_parallel_size > 1 and packed (THD)
sequences (both need TransformerEngine), so without TE this module is plugged in as
`core_attention` of the local layer spec. Each CP rank all-gathers K and V over the CP group and
masks by global position and, in a packed row, by document.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megalign.dump.layout import cp_bounds, cp_positions


class _GatherSequence(torch.autograd.Function):
    """All-gather on dim 0 over a group; the backward sums the gradients and keeps this rank's slice.

    torch.distributed.nn's all_gather would do, but its backward needs reduce_scatter, which gloo
    (the CPU backend) does not have; an all-reduce plus a slice works on every backend.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.length = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.length:(ctx.rank + 1) * ctx.length], None


class ZigzagCPAttention(MegatronModule):
    """Drop-in for megatron's DotProductAttention: same constructor and forward signature."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"megalign's CP attention supports causal masks only, not {attn_mask_type}")
        if attention_dropout or config.attention_dropout:
            raise ValueError("megalign's CP attention runs without attention dropout")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        # query [sq, b, heads, dim]; key, value [sk, b, groups, dim]: this CP rank's chunks. Packed (THD):
        # [t, heads, dim], one row whose documents attend only within themselves.
        if attention_bias is not None:
            raise ValueError("megalign's CP attention does not take an attention bias")
        packed = packed_seq_params is not None
        if packed:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        cp = self.cp_group.size() if self.cp_group is not None else 1
        rank = self.cp_group.rank() if cp > 1 else 0
        local_len = query.shape[0]
        bounds = cp_bounds(_document_bounds(packed_seq_params) if packed else None, local_len, cp)
        q_pos = cp_positions(bounds, rank, cp, device=query.device)
        k_pos = q_pos
        if cp > 1:
            key = _GatherSequence.apply(key, self.cp_group)
            value = _GatherSequence.apply(value, self.cp_group)
            k_pos = torch.cat([cp_positions(bounds, r, cp, device=query.device) for r in range(cp)])
        if self.heads != self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        scores = torch.einsum("sbnh,tbnh->bnst", query, key).float() * self.softmax_scale
        edges = torch.tensor(bounds, device=query.device)
        q_doc, k_doc = (torch.searchsorted(edges, pos, right=True) for pos in (q_pos, k_pos))
        hidden = (k_pos[None, :] > q_pos[:, None]) | (k_doc[None, :] != q_doc[:, None])
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).to(query.dtype)
        context = torch.einsum("bnst,tbnh->sbnh", probs, value)
        return context.reshape(local_len, context.shape[1], -1)


def _document_bounds(params) -> tuple[int, ...]:
    """Where the packed row's documents start, padding included (what the CP split cut by)."""
    bounds = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return tuple(bounds.tolist())
