"""Which dim of a megatron-core parameter tensor parallelism splits, from the parameter's name alone.

megatron marks a TP-split parameter with `tensor_model_parallel` and `partition_dim`; a dump that
recorded neither (sglang's dumper: `dump_model` writes names and values) still has megatron's names,
and they say it: column-parallel linears (linear_qkv, linear_fc1) and the vocab-parallel embedding
and output layer split their output rows (dim 0, their bias too); row-parallel linears (linear_proj,
linear_fc2) split their input columns (dim 1), their bias is whole on every rank. Norms, position
embeddings and routers are replicas. Under SwiGLU, linear_fc1 holds gate|up fused: each TP rank
holds its slice of both parts. The core attention's learnable softmax_offset (GPT-OSS's sinks, one
a head) is split by heads, though megatron-core does not mark it (split_by_name_only).
"""

from __future__ import annotations

import re
from typing import Optional

_COLUMN = re.compile(r"(^|\.)(linear_qkv|linear_fc1|word_embeddings|output_layer)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)(linear_proj|linear_fc2)\.(weight|bias)$")
_REPLICA = re.compile(r"norm|(^|\.)(position_embeddings|router)\.")
_GATED = re.compile(r"(^|\.)linear_fc1(\.|$)")
# Split over TP, though megatron-core gives them no tensor_model_parallel mark: DotProductAttention's
# sharded_state_dict says {'softmax_offset': 0}, and each rank holds its own heads' (0.19).
_UNMARKED = re.compile(r"(^|\.)core_attention\.softmax_offset$")


class UnknownParameter(ValueError):
    """A parameter name the rule does not know: its split cannot be told from the name."""


def tp_dim_by_name(name: str) -> Optional[int]:
    """The dim TP splits parameter `name` on; None where every TP rank holds it whole."""
    if _REPLICA.search(name):
        return None
    if _COLUMN.search(name) or _UNMARKED.search(name):
        return 0
    row = _ROW.search(name)
    if row:
        return 1 if row.group(3) == "weight" else None
    raise UnknownParameter(f"{name}: not a megatron-core parameter name whose TP split is known")


def gated_linear(name: str) -> bool:
    """`name` is (in) megatron's linear_fc1, which holds gate|up fused under SwiGLU."""
    return bool(_GATED.search(name))


def split_by_name_only(name: str) -> Optional[int]:
    """The dim TP splits `name` on where megatron-core marks no split (None: a replica, as unmarked
    parameters are)."""
    return 0 if _UNMARKED.search(name) else None
