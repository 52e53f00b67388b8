"""Which dim of a megatron-core parameter tensor parallelism splits, from the parameter's name alone.

megatron marks a TP-split parameter with `tensor_model_parallel` and `partition_dim`; a dump that
recorded neither (sglang's dumper: `dump_model` writes names and values) still has megatron's names,
and they say it: column-parallel linears (linear_qkv, linear_fc1) and the vocab-parallel embedding
and output layer split their output rows (dim 0, their bias too); row-parallel linears (linear_proj,
linear_fc2) split their input columns (dim 1), their bias is whole on every rank. Norms, position
embeddings and routers are replicas. Under SwiGLU, linear_fc1 holds gate|up fused: each TP rank
holds its slice of both parts.
"""

from __future__ import annotations

import re
from typing import Optional

_COLUMN = re.compile(r"(^|\.)(linear_qkv|linear_fc1|word_embeddings|output_layer)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)(linear_proj|linear_fc2)\.(weight|bias)$")
_REPLICA = re.compile(r"norm|(^|\.)(position_embeddings|router)\.")
_GATED = re.compile(r"(^|\.)linear_fc1(\.|$)")


class UnknownParameter(ValueError):
    """A parameter name the rule does not know: its split cannot be told from the name."""


def tp_dim_by_name(name: str) -> Optional[int]:
    """The dim TP splits parameter `name` on; None where every TP rank holds it whole."""
    if _REPLICA.search(name):
        return None
    if _COLUMN.search(name):
        return 0
    row = _ROW.search(name)
    if row:
        return 1 if row.group(3) == "weight" else None
    raise UnknownParameter(f"{name}: not a megatron-core parameter name whose TP split is known")


def gated_linear(name: str) -> bool:
    """`name` is (in) megatron's linear_fc1, which holds gate|up fused under SwiGLU."""
    return bool(_GATED.search(name))
