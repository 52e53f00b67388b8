"""The architectures megalign maps between transformers and megatron-core, one table per family.

A `Rule` names a megatron module and the HF module(s) it is made of, `{i}` standing for the layer
index. The same table gives the weights (`<module>.weight` / `.bias`), the parameter gradients and
the module outputs: see namemap.py for how the parts are joined.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from megalign.errors import UserError
from megalign.spec import ModelConfig

# The megatron activation name when it is the module's own name.
SAME = "same"


@dataclass(frozen=True)
class Rule:
    """A megatron module and the HF module(s) that hold the same computation."""

    megatron: str
    hf: tuple[str, ...]
    join: str = "copy"  # copy: one HF part; cat: gate|up on the output dim; qkv: megatron's GQA grouping
    # The megatron activation the HF output is written as: SAME, another name, or None when the
    # output is written some other way (the logits, from the model's output).
    activation: Optional[str] = SAME
    params: bool = True  # False: the megatron module holds no parameter of its own here
    # "output": the HF module's output; "input": its first input (forward pre-hook), for computations
    # that are a module in one stack and a bare function in the other.
    on: str = "output"
    # Which layers hold it: "all", or "dense" / "moe" where the first layers keep a dense MLP (GLM-4.5).
    layers: str = "all"
    when: Optional[str] = None  # a ModelConfig flag the module exists under (GLM's use_qk_norm is optional)

    def expand(self, layer: int, expert: int = 0) -> "Rule":
        return replace(self, megatron=self.megatron.format(i=layer, e=expert),
                       hf=tuple(h.format(i=layer, e=expert) for h in self.hf))

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.megatron


_L = "model.layers.{i}"
_M = "decoder.layers.{i}"


@dataclass(frozen=True)
class Experts:
    """Where a checkpoint keeps an MoE layer: the block's name on disk and each expert's linears.
    transformers 5 fuses the experts in memory (`mlp.experts.gate_up_proj` [experts, 2*ffn, hidden],
    `mlp.experts.down_proj`) and its router is `mlp.gate`, whatever the names on disk."""

    block: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str
    up: str
    down: str
    # GLM-4.5's shared expert (`mlp.shared_experts`, a gate/up/down MLP): megatron's shared_experts.
    shared: bool = False
    # The router's bias added to the scores for the choice only (`gate.e_score_correction_bias`, a
    # buffer): megatron's router.expert_bias buffer.
    expert_bias: bool = False

    def rules(self) -> tuple[Rule, ...]:
        moe, experts = f"{_L}.{self.block}", f"{_L}.{self.block}.experts.{{e}}"
        shared = f"{moe}.shared_experts"
        return tuple(replace(rule, layers="moe") for rule in (
            # Routing is written by the router's own hook (worker.py), as kind `routing`.
            Rule(f"{_M}.mlp.router", (f"{moe}.gate",), activation=None),
            Rule(f"{_M}.mlp.experts.{{e}}.linear_fc1", (f"{experts}.{self.gate}", f"{experts}.{self.up}"), join="cat",
                 activation=None),
            Rule(f"{_M}.mlp.experts.{{e}}.linear_fc2", (f"{experts}.{self.down}",), activation=None),
            *((Rule(f"{_M}.mlp.shared_experts.linear_fc1", (f"{shared}.gate_proj", f"{shared}.up_proj"), join="cat"),
               Rule(f"{_M}.mlp.shared_experts.linear_fc2", (f"{shared}.down_proj",)),
               Rule(f"{_M}.mlp.shared_experts", (shared,), params=False)) if self.shared else ()),
        ))

    def buffers(self, layer: int) -> dict[str, str]:
        """The MoE layer's buffers a checkpoint holds: megatron name -> HF name. A loader that sets only
        parameters would leave megatron's expert_bias at zeros, routing as if unbiased."""
        if not self.expert_bias:
            return {}
        return {f"decoder.layers.{layer}.mlp.router.expert_bias":
                f"model.layers.{layer}.{self.block}.gate.e_score_correction_bias"}

    def checkpoint_grads(self, name: str, grad: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        """An in-memory parameter's gradient under the checkpoint's names (the experts unfused)."""
        prefix = f"model.layers.{layer}.{self.block}"
        if name.endswith(".mlp.gate.weight"):
            return {f"{prefix}.gate.weight": grad}
        if name.endswith(".mlp.experts.gate_up_proj"):
            halves = [g.chunk(2, dim=0) for g in grad]
            return {**{f"{prefix}.experts.{e}.{self.gate}.weight": h[0] for e, h in enumerate(halves)},
                    **{f"{prefix}.experts.{e}.{self.up}.weight": h[1] for e, h in enumerate(halves)}}
        if name.endswith(".mlp.experts.down_proj"):
            return {f"{prefix}.experts.{e}.{self.down}.weight": g for e, g in enumerate(grad)}
        return {name: grad}


def _decoder_rules(qk_norm: bool = False, experts: Optional[Experts] = None) -> tuple[Rule, ...]:
    """The Llama layout, layer by layer in execution order; `qk_norm`: Qwen3's RMSNorm over head_dim
    on each query and key head, before RoPE; `experts`: an MoE block in place of the MLP (in the layers
    ModelConfig.is_moe_layer names; the dense MLP in the others)."""
    dense_mlp = tuple(replace(rule, layers="dense") for rule in (
        Rule(f"{_M}.mlp.linear_fc1", (f"{_L}.mlp.gate_proj", f"{_L}.mlp.up_proj"), join="cat"),
        # SwiGLU's output, act(gate) * up: a bare function in both stacks, so the down projection's input.
        Rule(f"{_M}.mlp.linear_fc2#input", (f"{_L}.mlp.down_proj",), params=False, on="input"),
        Rule(f"{_M}.mlp.linear_fc2", (f"{_L}.mlp.down_proj",)),
    ))
    return (
        # megatron's `embedding` output is the lookup made sequence-first, the layout of every layer output.
        Rule("embedding.word_embeddings", ("model.embed_tokens",), activation="embedding"),
        Rule(f"{_M}.input_layernorm", (f"{_L}.input_layernorm",)),
        Rule(f"{_M}.self_attention.linear_qkv",
             (f"{_L}.self_attn.q_proj", f"{_L}.self_attn.k_proj", f"{_L}.self_attn.v_proj"), join="qkv"),
        *((Rule(f"{_M}.self_attention.q_layernorm", (f"{_L}.self_attn.q_norm",), when="qk_layernorm"),
           Rule(f"{_M}.self_attention.k_layernorm", (f"{_L}.self_attn.k_norm",), when="qk_layernorm"))
          if qk_norm else ()),
        # The attention output before the output projection: megatron's core_attention module, o_proj's input.
        Rule(f"{_M}.self_attention.core_attention", (f"{_L}.self_attn.o_proj",), params=False, on="input"),
        Rule(f"{_M}.self_attention.linear_proj", (f"{_L}.self_attn.o_proj",)),
        Rule(f"{_M}.self_attention", (f"{_L}.self_attn",), params=False),
        Rule(f"{_M}.pre_mlp_layernorm", (f"{_L}.post_attention_layernorm",)),
        *(experts.rules() if experts else ()), *dense_mlp,
        # The MLP's (or MoE block's) output: `mlp` in memory in every family.
        Rule(f"{_M}.mlp", (f"{_L}.mlp",), params=False),
        Rule(_M, (_L,), params=False),
        Rule("decoder.final_layernorm", ("model.norm",)),
        Rule("output_layer", ("lm_head",), activation=None),
    )


LLAMA_RULES = _decoder_rules()
# Qwen2 is Llama with biases on q/k/v: megatron's add_qkv_bias, grouped like the weight (namemap.py).
QWEN2_RULES = LLAMA_RULES
QWEN3_RULES = _decoder_rules(qk_norm=True)
QWEN3_MOE_EXPERTS = Experts(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL_EXPERTS = Experts(block="block_sparse_moe", gate="w1", up="w3", down="w2")
GLM4_MOE_EXPERTS = Experts(block="mlp", gate="gate_proj", up="up_proj", down="down_proj", shared=True,
                           expert_bias=True)


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    rules: tuple[Rule, ...]
    config: Callable[[dict, str], dict] = field(repr=False)  # family-specific ModelConfig fields
    experts: Optional[Experts] = None  # MoE families


def _llama(raw: dict, source: str) -> dict:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise UserError(f"{source}: attention_bias/mlp_bias=true puts a bias on o_proj or the MLP, which the "
                        "mapping cannot express (megatron's add_bias_linear biases every linear)")
    return {}


def _qwen2(raw: dict, source: str) -> dict:
    _no_sliding_window(raw, source)
    return {"add_qkv_bias": True}


def _qwen3(raw: dict, source: str) -> dict:
    _no_sliding_window(raw, source)
    if raw.get("attention_bias"):
        raise UserError(f"{source}: attention_bias=true also biases o_proj, which the mapping cannot express")
    return {"qk_layernorm": True}


def _qwen3_moe(raw: dict, source: str) -> dict:
    if raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
        raise UserError(f"{source}: dense layers among the MoE layers (decoder_sparse_step, mlp_only_layers) are "
                        "not supported")
    # HF: softmax over all experts, top-k, renormalised when norm_topk_prob. megatron: top-k of the logits
    # then softmax over them (the renormalised form), or softmax first (moe_router_pre_softmax).
    return {**_qwen3(raw, source), **_moe(raw, source, ffn="moe_intermediate_size"),
            "moe_router_pre_softmax": not raw.get("norm_topk_prob", False)}


def _mixtral(raw: dict, source: str) -> dict:
    if raw.get("sliding_window"):
        raise UserError(f"{source}: sliding_window={raw['sliding_window']} (sliding-window attention) is not supported")
    return {**_llama(raw, source), **_moe(raw, source, ffn="intermediate_size")}


def _glm4_moe(raw: dict, source: str) -> dict:
    if raw.get("n_shared_experts", 1) < 1:
        raise UserError(f"{source}: n_shared_experts={raw['n_shared_experts']}: the GLM-4.5 mapping needs a "
                        "shared expert")
    return {**_glm_attention(raw), **_moe(raw, source, ffn="moe_intermediate_size"),
            **_sigmoid_router(raw, source), "moe_dense_layers": raw.get("first_k_dense_replace", 1),
            "moe_shared_expert_intermediate_size": raw["moe_intermediate_size"] * raw.get("n_shared_experts", 1),
            "rotary_percent": float(_rope(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5)))}


def _glm_attention(raw: dict) -> dict:
    """GLM-4.5's attention: Llama's, biased on q/k/v only (attention_bias leaves o_proj unbiased), with
    Qwen3's per-head q/k norms when use_qk_norm."""
    return {"add_qkv_bias": bool(raw.get("attention_bias", False)), "qk_layernorm": bool(raw.get("use_qk_norm", False))}


def _sigmoid_router(raw: dict, source: str) -> dict:
    """DeepSeek-style routing: sigmoid scores, the choice made on scores + e_score_correction_bias
    within the best groups, the weights the chosen scores renormalised and scaled."""
    if not raw.get("norm_topk_prob", True):
        raise UserError(f"{source}: norm_topk_prob=false with sigmoid scoring: megatron-core always renormalises "
                        "the chosen scores")
    groups, keep, topk = raw.get("n_group", 1) or 1, raw.get("topk_group", 1) or 1, raw["num_experts_per_tok"]
    if groups > 1 and topk // keep != 2:
        raise UserError(f"{source}: n_group={groups} with num_experts_per_tok // topk_group = {topk // keep}: "
                        "transformers scores a group by its top 2 experts, megatron-core by its top "
                        "num_experts_per_tok // topk_group")
    # transformers keeps this router's weight and bias in float32 (_keep_in_fp32_modules_strict) and scores in float32.
    return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_fp32": True,
            "moe_router_topk_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
            **({"moe_router_num_groups": groups, "moe_router_group_topk": keep} if groups > 1 else {})}


def _moe(raw: dict, source: str, ffn: str) -> dict:
    # transformers 5 writes num_local_experts for most families; Qwen3-MoE checkpoints on the hub
    # num_experts, GLM n_routed_experts.
    experts = raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts")
    if experts is None:
        raise UserError(f"{source}: config.json has none of num_local_experts, num_experts, n_routed_experts")
    try:
        return {"num_moe_experts": experts, "moe_router_topk": raw["num_experts_per_tok"],
                "moe_ffn_hidden_size": raw[ffn], "moe_router_score_function": "softmax"}
    except KeyError as e:
        raise UserError(f"{source}: config.json has no {e.args[0]!r}") from None


def _no_sliding_window(raw: dict, source: str) -> None:
    if raw.get("use_sliding_window"):
        raise UserError(f"{source}: use_sliding_window=true (sliding-window attention) is not supported")


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", LLAMA_RULES, _llama),
    Family("qwen2", "Qwen2ForCausalLM", QWEN2_RULES, _qwen2),
    Family("qwen3", "Qwen3ForCausalLM", QWEN3_RULES, _qwen3),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _decoder_rules(qk_norm=True, experts=QWEN3_MOE_EXPERTS), _qwen3_moe,
           experts=QWEN3_MOE_EXPERTS),
    Family("mixtral", "MixtralForCausalLM", _decoder_rules(experts=MIXTRAL_EXPERTS), _mixtral,
           experts=MIXTRAL_EXPERTS),
    Family("glm4_moe", "Glm4MoeForCausalLM", _decoder_rules(qk_norm=True, experts=GLM4_MOE_EXPERTS), _glm4_moe,
           experts=GLM4_MOE_EXPERTS),
)}


def family_of(raw: dict, source: str) -> Family:
    family = FAMILIES.get(raw.get("model_type"))
    architectures = raw.get("architectures") or []
    if family is None or (architectures and architectures[0] != family.architecture):
        supported = ", ".join(f"{f.architecture} (model_type {f.model_type})" for f in FAMILIES.values())
        found = architectures[0] if architectures else f"model_type {raw.get('model_type')!r}"
        raise UserError(f"{source}: unsupported architecture {found}; supported: {supported}")
    return family


def model_config(raw: dict, family: Family, name: str, source: str) -> ModelConfig:
    """config.json -> ModelConfig; UserError for whatever the mapping cannot express."""
    if raw.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: hidden_act={raw['hidden_act']!r}; only silu (SwiGLU) is supported")
    try:
        heads = raw["num_attention_heads"]
        fields = dict(
            name=name, num_layers=raw["num_hidden_layers"], hidden_size=raw["hidden_size"],
            num_attention_heads=heads, num_query_groups=raw.get("num_key_value_heads") or heads,
            ffn_hidden_size=raw["intermediate_size"], vocab_size=raw["vocab_size"],
            # Always explicit: Qwen3's head_dim need not be hidden_size / heads.
            kv_channels=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rotary_base=float(_rope_theta(raw, source)), layernorm_epsilon=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            position_embedding="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        )
    except KeyError as e:
        raise UserError(f"{source}: config.json has no {e.args[0]!r}") from None
    fields.update(family.config(raw, source))
    return ModelConfig.from_dict(fields, source=source)


def _rope(raw: dict) -> dict:
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope_theta(raw: dict, source: str) -> float:
    """transformers 5 writes rope_parameters; older checkpoints rope_theta and rope_scaling."""
    rope = _rope(raw)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UserError(f"{source}: RoPE scaling {kind!r} is not supported (only plain RoPE)")
    return rope.get("rope_theta", raw.get("rope_theta", 10000.0))
