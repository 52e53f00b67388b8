"""sglang's module names, as its dumper's non-intrusive hooks write them, in megalign's (megatron's) names:
Llama's (Qwen2's), DeepSeek-V3's (MLA), GLM-4.5's and GPT-OSS's, one table (no name means two things).

sglang's Llama code (srt/models/llama.py) keeps transformers' module names but fuses some modules
and threads the residual through the norms: `input_layernorm` and `post_attention_layernorm` (for
every layer but the first's input norm) take (hidden, residual) and return (normed, residual), and
`model.norm` returns (normed, residual). The dumper writes a tuple's tensors as `.output.0`,
`.output.1`, which sglang.logical_name reads as `M` and `M#1`. So a norm's output is its first
tensor. sglang before its layer boundaries returned (mlp output, residual) from a decoder layer:
megatron's layer output is the sum of the two. sglang 0.5.23's layers return the FFN's contribution
alone, the residual carried in the forward batch's residual stream (layers/layer_boundary/stage.py,
`finish`): a lone layer output is not megatron's and is left out. `gate_up_proj` is gate|up on the
output dim, as megatron's linear_fc1; `act_fn` (SiluAndMul) is SwiGLU, megatron's linear_fc2 input;
o_proj's input is the attention's output, megatron's core_attention. The fused `qkv_proj` lays q|k|v
out apart, where megatron groups them by query group: not mapped (GLM-4.5's and GPT-OSS's alike).

DeepSeek-V3 (srt/models/deepseek_v2.py, DeepseekV2AttentionMLA.__init__): with q_lora_rank,
`fused_qkv_a_proj_with_mqa` is q_a_proj | kv_a_proj_with_mqa on the output dim (prepare_qkv_latent
concatenates them in that order where they are apart): megatron's linear_q_down_proj is q_a_layernorm's
input, its linear_kv_down_proj the fused output's columns after q_a_layernorm's width. Without
q_lora_rank, `q_proj` and `kv_a_proj_with_mqa` are apart. `kv_b_proj` runs only in sglang's MHA
passes (an absorbed pass multiplies by its w_kc and w_vc, weights and no module): not mapped, or a
server's decode passes would lack its rows.

The MoE block (DeepSeek's and GLM's `mlp.gate`, GPT-OSS's `mlp.router`) gives the router logits, and
its `topk` (a StandardTopKOutput: weights, ids, logits) the experts chosen, made megalign's routing
records: the ids sorted by their weights, highest first, as megatron's. sglang's topk weights are
not compared: routed_scaling_factor is in them or applied after the experts, as the MoE backend
chooses. `mlp.experts` (the routed experts' sum) has no megatron output: megatron's experts
module's output is per dispatched token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

from megalign.dump.format import Kind


@dataclass(frozen=True)
class Target:
    """The megalign record an sglang tensor is (`{0}` in the names: the layer index)."""

    name: str
    kind: Kind = Kind.ACTIVATION
    # The sum of this tensor and the dumped one of the same name with `#1`: the layer's output is its
    # MLP output plus its residual; without that `#1` there is no such record (left out).
    summed: bool = False
    # A fused projection's tail: the columns after the width of this sglang tensor (its first part's).
    after: Optional[str] = None
    # Expert ids, sorted by these weights (the same tokens' top-k weights), highest first.
    weights: Optional[str] = None


_LAYER = r"model\.layers\.(\d+)"
_ATTN, _MLP = rf"{_LAYER}\.self_attn", rf"{_LAYER}\.mlp"
_SA, _M = "decoder.layers.{0}.self_attention", "decoder.layers.{0}.mlp"
_ROUTER = Target(f"{_M}.router.logits", Kind.ROUTING)
# (sglang logical name, its record), the first that matches.
_MAP = tuple((re.compile(pattern + "$"), target if isinstance(target, Target) else Target(target))
             for pattern, target in (
    (r"model\.embed_tokens", "embedding"),
    (rf"{_LAYER}\.input_layernorm", "decoder.layers.{0}.input_layernorm"),
    # Multi-latent attention (DeepSeek-V3).
    (rf"{_ATTN}\.q_a_layernorm\.inputs\.0", f"{_SA}.linear_q_down_proj"),
    (rf"{_ATTN}\.fused_qkv_a_proj_with_mqa",
     Target(f"{_SA}.linear_kv_down_proj", after="model.layers.{0}.self_attn.q_a_layernorm")),
    (rf"{_ATTN}\.q_proj", f"{_SA}.linear_q_proj"),
    (rf"{_ATTN}\.kv_a_proj_with_mqa", f"{_SA}.linear_kv_down_proj"),
    (rf"{_ATTN}\.q_a_layernorm", f"{_SA}.q_layernorm"),
    (rf"{_ATTN}\.kv_a_layernorm", f"{_SA}.kv_layernorm"),
    (rf"{_ATTN}\.q_b_proj", f"{_SA}.linear_q_up_proj"),
    (rf"{_ATTN}\.o_proj\.inputs\.0", f"{_SA}.core_attention"),
    (rf"{_ATTN}\.o_proj", f"{_SA}.linear_proj"),
    (_ATTN, _SA),
    (rf"{_LAYER}\.post_attention_layernorm", "decoder.layers.{0}.pre_mlp_layernorm"),
    # The MoE block (DeepSeek-V3, GLM-4.5, GPT-OSS).
    (rf"{_MLP}\.(gate|router)", _ROUTER),
    (rf"{_MLP}\.topk#1", Target(f"{_M}.router.experts", Kind.ROUTING, weights="model.layers.{0}.mlp.topk")),
    (rf"{_MLP}\.shared_experts\.gate_up_proj", f"{_M}.shared_experts.linear_fc1"),
    (rf"{_MLP}\.shared_experts\.down_proj", f"{_M}.shared_experts.linear_fc2"),
    (rf"{_MLP}\.shared_experts", f"{_M}.shared_experts"),
    # The dense MLP.
    (rf"{_MLP}\.gate_up_proj", f"{_M}.linear_fc1"),
    (rf"{_MLP}\.act_fn", f"{_M}.linear_fc2#input"),
    (rf"{_MLP}\.down_proj", f"{_M}.linear_fc2"),
    (_MLP, _M),
    (rf"{_LAYER}(#1)?", Target("decoder.layers.{0}", summed=True)),
    (r"model\.norm", "decoder.final_layernorm"),
))
# The logits processor's output: one row per request a pass, its last token's next-token logits.
PER_REQUEST = {"logits_processor.output.next_token_logits": "logits"}


def megatron_name(name: str) -> Optional[Target]:
    """The megalign record of an sglang module's output named `name` (`M`, its i-th output `M#i`, an input
    `M.inputs.0`), or None where there is none."""
    for pattern, target in _MAP:
        match = pattern.match(name)
        if match:
            layer = match.group(1) if pattern.groups else None
            fill = (lambda text: text.format(layer)) if layer is not None else (lambda text: text)
            return replace(target, name=fill(target.name), after=target.after and fill(target.after),
                           weights=target.weights and fill(target.weights))
    return None
