"""transformers' models as megalign's HF worker captures them (stacks/hf/worker.py), in megatron's
names and layout: what a module's output is laid out as, which modules of transformers 5's MoE
block are the router and the experts, and the router's decisions as megatron's routing records.
The map of the remaining module and parameter names to megatron's, family by family, is the
stack's (stacks/hf/namemap.py: the same map loads the checkpoint's weights).
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from megalign.dump.sharding import Sharding

SEQ_FIRST = Sharding(seq_dim=0, dp_dim=1)  # megatron's layout of module outputs
BATCH_FIRST = Sharding(seq_dim=1, dp_dim=0)  # transformers' outputs, inputs, logits, logprobs

# transformers 5's MoE block, in memory in every family: `mlp.gate` (the router; GPT-OSS's `mlp.router`)
# and `mlp.experts`.
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|router)$")
_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts(\.|$)")


def router_layer(name: str) -> Optional[int]:
    """The layer of the MoE router module `name`; None where it is none."""
    match = _ROUTER.match(name)
    return int(match.group(1)) if match else None


def is_experts(name: str) -> bool:
    """The experts, fused in one module: their tokens are permuted, as in megatron's (not dumped)."""
    return bool(_EXPERTS.match(name))


def megatron_router(layer: int) -> str:
    return f"decoder.layers.{layer}.mlp.router"


def routing_records(layer: int, output: tuple, seq_len: int) -> dict[str, torch.Tensor]:
    """A router's (logits, weights, experts) over [b*s] tokens as megatron's routing records, by
    name: [s, b, ...], laid out as SEQ_FIRST. The experts highest weight first, as megatron's records:
    DeepSeek-V3's and GLM-4.5's routers pick them with topk(sorted=False)."""
    logits, weights, experts = output
    weights, order = weights.sort(dim=-1, descending=True, stable=True)
    experts = experts.gather(-1, order)
    return {f"{megatron_router(layer)}.{what}": tensor.detach().view(-1, seq_len, tensor.shape[-1]).transpose(0, 1)
            for what, tensor in (("logits", logits), ("experts", experts), ("weights", weights))}


def output_sharding(tensor: torch.Tensor, seq_len: int) -> Sharding:
    """A transformers module's output with no megatron counterpart, as it is: batch-first, its
    sequence dim where it has the batch's tokens."""
    seq_dim = 1 if tensor.ndim > 1 and tensor.shape[1] == seq_len else None
    return Sharding(seq_dim=seq_dim, dp_dim=0 if seq_dim is not None else None)
