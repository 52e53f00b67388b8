"""sglang's Llama module names, as its dumper's non-intrusive hooks write them, in megalign's (megatron's) names.

sglang's Llama code (srt/models/llama.py) keeps transformers' module names but fuses some modules
and threads the residual through the norms: `input_layernorm` and `post_attention_layernorm` (for
every layer but the first's input norm) take (hidden, residual) and return (normed, residual), the
decoder layer returns (mlp output, residual), and `model.norm` returns (normed, residual). The
dumper writes a tuple's tensors as `.output.0`, `.output.1`, which sglang.logical_name reads as `M`
and `M#1`. So a norm's output is its first tensor, and megatron's layer output, the sum of the
residual and the MLP's output, is the sum of the layer's two tensors. `gate_up_proj` is gate|up on
the output dim, as megatron's linear_fc1; `act_fn` (SiluAndMul) is SwiGLU, megatron's linear_fc2
input; o_proj's input is the attention's output, megatron's core_attention. The fused `qkv_proj`
lays q|k|v out apart, where megatron groups them by query group: not mapped.
"""

from __future__ import annotations

import re
from typing import Optional

_LAYER = r"model\.layers\.(\d+)"
# (sglang logical name, megatron name); "{0}" is the layer index.
_MAP = tuple((re.compile(pattern + "$"), target) for pattern, target in (
    (r"model\.embed_tokens", "embedding"),
    (rf"{_LAYER}\.input_layernorm", "decoder.layers.{0}.input_layernorm"),
    (rf"{_LAYER}\.self_attn\.o_proj\.inputs\.0", "decoder.layers.{0}.self_attention.core_attention"),
    (rf"{_LAYER}\.self_attn\.o_proj", "decoder.layers.{0}.self_attention.linear_proj"),
    (rf"{_LAYER}\.self_attn", "decoder.layers.{0}.self_attention"),
    (rf"{_LAYER}\.post_attention_layernorm", "decoder.layers.{0}.pre_mlp_layernorm"),
    (rf"{_LAYER}\.mlp\.gate_up_proj", "decoder.layers.{0}.mlp.linear_fc1"),
    (rf"{_LAYER}\.mlp\.act_fn", "decoder.layers.{0}.mlp.linear_fc2#input"),
    (rf"{_LAYER}\.mlp\.down_proj", "decoder.layers.{0}.mlp.linear_fc2"),
    (rf"{_LAYER}\.mlp", "decoder.layers.{0}.mlp"),
    (_LAYER, "decoder.layers.{0}"),
    (r"model\.norm", "decoder.final_layernorm"),
))
# The logits processor's output: one row per request a pass, its last token's next-token logits.
PER_REQUEST = {"logits_processor.output.next_token_logits": "logits"}
# The layer outputs: megatron's is the sum of sglang's two tensors (the MLP's output and the residual).
SUMMED = re.compile(_LAYER + "$")


def megatron_name(name: str) -> Optional[str]:
    """megalign's name for an sglang Llama module's (first) output, or None where there is none."""
    for pattern, target in _MAP:
        match = pattern.match(name)
        if match:
            return target.format(*match.groups())
    return None
