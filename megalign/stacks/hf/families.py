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
    on: str = "output"  # or "none": a rule of parameters only, whose HF module's output another rule writes
    layers: str = "all"  # "dense" or "moe": a rule of only the dense or only the MoE layers (moe_layer_freq)
    when: Optional[str] = None  # a ModelConfig flag the module exists under (GLM's use_qk_norm is optional)
    # Buffers loaded with the weights, (megatron's name, HF's) under the modules': no gradient, no output.
    buffers: tuple[tuple[str, str], ...] = ()
    # The parameters, (megatron's name, HF's), where they are not the module's weight (and bias, where biased):
    # GPT-OSS's sinks, megatron's core_attention.softmax_offset.
    tensors: tuple[tuple[str, str], ...] = ()
    # Under add_bias_linear megatron returns this module's output without its last linear's bias and the bias
    # apart (output #1, for the fused bias-dropout-add): the HF linear holding it, relative to the HF module
    # ("" itself), whose bias the HF capture takes off and writes apart likewise.
    bias_apart: Optional[str] = None

    def expand(self, layer: int, expert: int = 0) -> "Rule":
        return replace(self, megatron=self.megatron.format(i=layer, e=expert),
                       hf=tuple(h.format(i=layer, e=expert) for h in self.hf))

    @property
    def written_as(self) -> Optional[str]:
        """The name the HF output is written under; None where it is written some other way."""
        return self.megatron if self.activation == SAME else self.activation

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
    router: str = "gate"  # GPT-OSS's is `mlp.router`
    # GPT-OSS keeps its experts fused on disk as in memory, transposed, gate and up interleaved
    # (gate_up_proj [experts, hidden, 2*ffn], gate `::2`, up `1::2`; down_proj [experts, ffn, hidden]), each
    # with a bias (`gate_up_proj_bias`, `down_proj_bias`): read as per-expert gate/up/down tensors (unfuse).
    interleaved: bool = False
    # DeepSeek's MoE (GLM-4.5's too): a shared expert (`mlp.shared_experts`, a gate/up/down MLP, megatron's
    # shared_experts) and the router's bias added to the scores for the choice only
    # (`gate.e_score_correction_bias`, a buffer: megatron's router.expert_bias buffer).
    deepseek: bool = False

    def rules(self) -> tuple[Rule, ...]:
        moe, experts = f"{_L}.{self.block}", f"{_L}.{self.block}.experts.{{e}}"
        shared = f"{moe}.shared_experts"
        return tuple(replace(rule, layers="moe") for rule in (
            # Routing is written by the router's own hook (worker.py), as kind `routing`.
            Rule(f"{_M}.mlp.router", (f"{moe}.{self.router}",), activation=None,
                 buffers=(("expert_bias", "e_score_correction_bias"),) if self.deepseek else ()),
            Rule(f"{_M}.mlp.experts.{{e}}.linear_fc1", (f"{experts}.{self.gate}", f"{experts}.{self.up}"), join="cat",
                 activation=None),
            Rule(f"{_M}.mlp.experts.{{e}}.linear_fc2", (f"{experts}.{self.down}",), activation=None),
            *((Rule(f"{_M}.mlp.shared_experts.linear_fc1", (f"{shared}.gate_proj", f"{shared}.up_proj"), join="cat"),
               Rule(f"{_M}.mlp.shared_experts.linear_fc2", (f"{shared}.down_proj",)),
               Rule(f"{_M}.mlp.shared_experts", (shared,), params=False)) if self.deepseek else ()),
        ))

    def checkpoint_grads(self, name: str, grad: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        """An in-memory parameter's gradient under the checkpoint's names (the experts unfused)."""
        prefix = f"model.layers.{layer}.{self.block}"
        if self.interleaved:
            return self.unfuse(name, grad)
        if name.endswith(".mlp.gate.weight"):
            return {f"{prefix}.gate.weight": grad}
        if name.endswith(".mlp.experts.gate_up_proj"):
            halves = [g.chunk(2, dim=0) for g in grad]
            return {**{f"{prefix}.experts.{e}.{self.gate}.weight": h[0] for e, h in enumerate(halves)},
                    **{f"{prefix}.experts.{e}.{self.up}.weight": h[1] for e, h in enumerate(halves)}}
        if name.endswith(".mlp.experts.down_proj"):
            return {f"{prefix}.experts.{e}.{self.down}.weight": g for e, g in enumerate(grad)}
        return {name: grad}

    def unfuse(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """GPT-OSS's fused expert tensor (a weight or its gradient, on disk or in memory: the same layout) as
        per-expert tensors in the nn.Linear layout ([out, in]) under per-expert names; any other as it is."""
        fused, _, kind = name.rpartition(".experts.")
        suffix = "bias" if kind.endswith("_bias") else "weight"
        if kind.removesuffix("_bias") == "gate_up_proj":
            # [E, H, 2I] -> per expert [2I, H]; [E, 2I] -> [2I]: the interleaved columns become rows.
            rows = tensor if suffix == "bias" else tensor.transpose(1, 2)
            parts = ((self.gate, rows[:, 0::2]), (self.up, rows[:, 1::2]))
        elif kind.removesuffix("_bias") == "down_proj":
            parts = ((self.down, tensor if suffix == "bias" else tensor.transpose(1, 2)),)
        else:
            return {name: tensor}
        return {f"{fused}.experts.{e}.{linear}.{suffix}": values[e] for linear, values in parts
                for e in range(values.shape[0])}


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
        Rule(f"{_M}.self_attention.linear_proj", (f"{_L}.self_attn.o_proj",), bias_apart=""),
        Rule(f"{_M}.self_attention", (f"{_L}.self_attn",), params=False, bias_apart="o_proj"),
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
DEEPSEEK_EXPERTS = Experts(block="mlp", gate="gate_proj", up="up_proj", down="down_proj", deepseek=True)
GPT_OSS_EXPERTS = Experts(block="mlp", gate="gate_proj", up="up_proj", down="down_proj", router="router",
                          interleaved=True)


def _gpt_oss_rules() -> tuple[Rule, ...]:
    """Llama's layout with biased linears everywhere (ModelConfig.add_bias_linear), the sinks as the core
    attention's softmax_offset, and the MoE block with GPT-OSS's fused experts and `mlp.router`."""
    sinks = Rule(f"{_M}.self_attention.core_attention", (f"{_L}.self_attn",), activation=None, on="none",
                 tensors=(("softmax_offset", "sinks"),))
    rules = _decoder_rules(experts=GPT_OSS_EXPERTS)
    at = next(i for i, rule in enumerate(rules) if rule.megatron.endswith(".self_attention.core_attention"))
    return (*rules[:at], sinks, *rules[at:])


def _deepseek_v3_rules(q_lora: bool) -> tuple[Rule, ...]:
    """Multi-latent attention, then the dense MLP in the first first_k_dense_replace layers and in the
    others the MoE block: its router (with the score-correction bias, a buffer), routed experts and
    shared experts. `q_lora`: q_lora_rank set (q_a_proj, q_a_layernorm, q_b_proj), else one q_proj."""
    attn, sa = f"{_L}.self_attn", f"{_M}.self_attention"
    query = (Rule(f"{sa}.linear_q_down_proj", (f"{attn}.q_a_proj",)),
             Rule(f"{sa}.q_layernorm", (f"{attn}.q_a_layernorm",)),
             Rule(f"{sa}.linear_q_up_proj", (f"{attn}.q_b_proj",))) if q_lora else \
        (Rule(f"{sa}.linear_q_proj", (f"{attn}.q_proj",)),)
    llama = {rule.megatron: rule for rule in _decoder_rules()}
    dense = [llama[name] for name in (f"{_M}.mlp.linear_fc1", f"{_M}.mlp.linear_fc2#input", f"{_M}.mlp.linear_fc2")]
    return (
        llama["embedding.word_embeddings"], llama[f"{_M}.input_layernorm"], *query,
        Rule(f"{sa}.linear_kv_down_proj", (f"{attn}.kv_a_proj_with_mqa",)),
        Rule(f"{sa}.kv_layernorm", (f"{attn}.kv_a_layernorm",)),
        Rule(f"{sa}.linear_kv_up_proj", (f"{attn}.kv_b_proj",)),
        *(llama[name] for name in (f"{sa}.core_attention", f"{sa}.linear_proj", sa, f"{_M}.pre_mlp_layernorm")),
        *DEEPSEEK_EXPERTS.rules(), *dense,
        *(llama[name] for name in (f"{_M}.mlp", _M, "decoder.final_layernorm", "output_layer")),
    )


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    # The table, or a function of the model giving it where the modules depend on the config.
    rules: tuple[Rule, ...] | Callable[[ModelConfig], tuple[Rule, ...]]
    config: Callable[[dict, str], dict] = field(repr=False)  # family-specific ModelConfig fields
    experts: Optional[Experts] = None  # MoE families
    # config.json, ModelConfig -> {a megatron module's last name: the order of its HF rows}, where megatron
    # reads a weight's rows in another order than the checkpoint lays them out (namemap.py applies it).
    row_orders: Callable[[dict, ModelConfig], dict[str, torch.Tensor]] = field(default=lambda raw, model: {},
                                                                                repr=False)

    def rules_of(self, model: ModelConfig) -> tuple[Rule, ...]:
        return self.rules(model) if callable(self.rules) else self.rules


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
    """GLM-4.5: Llama's attention biased on q/k/v only (attention_bias leaves o_proj unbiased), Qwen3's
    per-head q/k norms when use_qk_norm, RoPE on part of each head, DeepSeek's MoE."""
    return {"add_qkv_bias": bool(raw.get("attention_bias", False)), "qk_layernorm": bool(raw.get("use_qk_norm", False)),
            "rotary_percent": float(_rope(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))),
            **_deepseek_moe(raw, source, first_dense=1),
            # transformers keeps this router's weight and bias in float32 (_keep_in_fp32_modules_strict) and
            # scores in float32.
            "moe_router_fp32": True}


def _gpt_oss(raw: dict, source: str) -> dict:
    """GPT-OSS: biased attention with sinks, sliding-window attention on the layers layer_types names, softmax
    routing over biased router logits, experts with a clamped quick-GELU GLU: (up + 1) * gate * sigmoid(1.702 gate)."""
    if raw.get("quantization_config"):
        # The published experts are MXFP4 blocks and scales (gate_up_proj_blocks, _scales).
        raise UserError(f"{source}: quantized weights ({raw['quantization_config'].get('quant_method', '?')}) are "
                        "not read; dequantise to bf16 or fp32 first")
    if not raw.get("attention_bias", True):
        raise UserError(f"{source}: attention_bias=false leaves the attention unbiased and the experts biased, "
                        "which megatron's add_bias_linear cannot express")
    if raw.get("swiglu_alpha", 1.702) != 1.702:
        raise UserError(f"{source}: swiglu_alpha={raw['swiglu_alpha']}: megatron's quick_gelu is x * sigmoid(1.702 x)")
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise UserError(f"{source}: layer_types {sorted(set(types))}: only sliding_attention and full_attention")
    window, limit = raw.get("sliding_window"), raw.get("swiglu_limit", 7.0)
    fields = {**_moe(raw, source, ffn="intermediate_size"), "add_bias_linear": True, "softmax_type": "learnable",
              "activation": "quick_gelu", "glu_linear_offset": 1.0,
              "activation_func_clamp_value": None if limit is None else float(limit)}
    if window and "sliding_attention" in types:
        # transformers' window holds the query and the sliding_window - 1 keys before it.
        fields.update(window_size=[window - 1, 0], window_attn_skip_freq=[int(t == "sliding_attention") for t in types])
    return fields


def _deepseek_v3(raw: dict, source: str) -> dict:
    """MLA and DeepSeek's MoE."""
    if raw.get("quantization_config"):
        # DeepSeek-V3's published weights are FP8 blocks with weight_scale_inv beside them: read as they are,
        # they would be compared as numbers they are not.
        raise UserError(f"{source}: quantized weights ({raw['quantization_config'].get('quant_method', '?')}) are "
                        "not read; dequantise to bf16 or fp32 first")
    if raw.get("attention_bias"):
        raise UserError(f"{source}: attention_bias=true biases the MLA projections, which the mapping cannot express")
    return {**_deepseek_moe(raw, source, first_dense=0),
            "num_query_groups": raw["num_attention_heads"], "kv_channels": raw["v_head_dim"],
            "multi_latent_attention": True, "q_lora_rank": raw.get("q_lora_rank"),
            "kv_lora_rank": raw["kv_lora_rank"], "qk_head_dim": raw["qk_nope_head_dim"],
            "qk_pos_emb_head_dim": raw["qk_rope_head_dim"], "v_head_dim": raw["v_head_dim"],
            "qk_layernorm": True}


def _deepseek_moe(raw: dict, source: str, first_dense: int) -> dict:
    """DeepSeek's MoE (GLM-4.5's too): sigmoid scores, the score-correction bias choosing (not weighting) the
    experts, group-limited top-k, the chosen weights renormalised and scaled, shared experts, the first
    first_k_dense_replace layers dense. `first_dense`: the family's default first_k_dense_replace."""
    if raw.get("n_shared_experts", 1) < 1:
        raise UserError(f"{source}: n_shared_experts={raw['n_shared_experts']}: the mapping needs a shared expert")
    if not raw.get("norm_topk_prob", True):
        raise UserError(f"{source}: norm_topk_prob=false with sigmoid scores: megatron always renormalises the "
                        "chosen experts' weights")
    topk, groups, group_topk = raw["num_experts_per_tok"], raw.get("n_group") or 1, raw.get("topk_group") or 1
    if groups > 1 and topk // group_topk != 2:
        raise UserError(f"{source}: group-limited routing with num_experts_per_tok // topk_group = "
                        f"{topk} // {group_topk} != 2: transformers ranks groups by their top 2 scores, megatron "
                        f"by their top {topk // group_topk}")
    layers, dense = raw["num_hidden_layers"], raw.get("first_k_dense_replace", first_dense)
    return {**_moe(raw, source, ffn="moe_intermediate_size"),
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_topk_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
            "moe_shared_expert_intermediate_size": raw["moe_intermediate_size"] * raw.get("n_shared_experts", 1),
            **({"moe_router_num_groups": groups, "moe_router_group_topk": group_topk} if groups > 1 else {}),
            "moe_layer_freq": [0] * min(dense, layers) + [1] * max(layers - dense, 0)}


def _mla_rope_rows(raw: dict, model: ModelConfig) -> dict[str, torch.Tensor]:
    """megatron's MLA always reads the rope part of the query and key as interleaved pairs (x0, x1), (x2, x3)...
    and de-interleaves them; with rope_interleave=false transformers rotates the halves (x_i, x_{i+d/2}). The
    rope rows of q_b_proj (or q_proj; per head) and kv_a_proj_with_mqa are interleaved so that megatron computes
    the same."""
    if raw.get("rope_interleave", True):
        return {}
    rope, nope = model.qk_pos_emb_head_dim, model.qk_head_dim
    pairs = torch.arange(rope).view(2, -1).t().flatten()  # 0, d/2, 1, d/2 + 1, ...
    head = torch.cat([torch.arange(nope), nope + pairs])
    query = "linear_q_up_proj" if model.q_lora_rank is not None else "linear_q_proj"
    return {query: torch.cat([h * (nope + rope) + head for h in range(model.num_attention_heads)]),
            "linear_kv_down_proj": torch.cat([torch.arange(model.kv_lora_rank), model.kv_lora_rank + pairs])}


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
    Family("glm4_moe", "Glm4MoeForCausalLM", _decoder_rules(qk_norm=True, experts=DEEPSEEK_EXPERTS), _glm4_moe,
           experts=DEEPSEEK_EXPERTS),
    Family("gpt_oss", "GptOssForCausalLM", _gpt_oss_rules(), _gpt_oss, experts=GPT_OSS_EXPERTS),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", lambda model: _deepseek_v3_rules(model.q_lora_rank is not None),
           _deepseek_v3, experts=DEEPSEEK_EXPERTS, row_orders=_mla_rope_rows),
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
            **_rope_fields(raw, source), layernorm_epsilon=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        )
        fields.update(family.config(raw, source))
    except KeyError as e:
        raise UserError(f"{source}: config.json has no {e.args[0]!r}") from None
    if fields["position_embedding"] == "yarn":
        _check_yarn(fields, source)
    return ModelConfig.from_dict(fields, source=source)


def _rope(raw: dict) -> dict:
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope_fields(raw: dict, source: str) -> dict:
    """transformers 5 writes rope_parameters; older checkpoints rope_theta and rope_scaling. Plain RoPE, or YaRN
    as megatron's YarnRotaryEmbedding computes it (transformers' _compute_yarn_parameters)."""
    rope = _rope(raw)
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = {"rotary_base": float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))), "position_embedding": "rope"}
    if kind == "default":
        return theta
    if kind != "yarn":
        raise UserError(f"{source}: RoPE scaling {kind!r} is not supported (plain RoPE and yarn only)")
    if rope.get("attention_factor") is not None:
        raise UserError(f"{source}: YaRN attention_factor={rope['attention_factor']}: megatron derives it from "
                        "factor, mscale and mscale_all_dim only")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    original = raw.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
        or raw["max_position_embeddings"]
    return {**theta, "position_embedding": "yarn",
            "yarn_rotary_scaling_factor": float(rope.get("factor") or raw["max_position_embeddings"] / original),
            "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(rope.get("beta_fast") or 32), "yarn_beta_slow": float(rope.get("beta_slow") or 1),
            # transformers takes their ratio only when both are set and non-zero, else 0.1 ln(factor) + 1 (megatron:
            # when neither is None); MLA also scales its softmax by mscale_all_dim alone.
            "yarn_mscale": float(mscale) if mscale and mscale_all_dim else None,
            "yarn_mscale_all_dim": float(mscale_all_dim) if mscale_all_dim else None,
            "yarn_correction_range_round_to_int": bool(rope.get("truncate", True))}


def _check_yarn(fields: dict, source: str) -> None:
    if fields.get("rotary_percent", 1.0) != 1.0:
        # megatron's YarnRotaryEmbedding sizes its frequencies from the whole head (kv_channels).
        raise UserError(f"{source}: YaRN with partial_rotary_factor={fields['rotary_percent']}: megatron's YaRN "
                        "spans the whole head")
    if fields.get("multi_latent_attention") and not fields["yarn_correction_range_round_to_int"]:
        raise UserError(f"{source}: YaRN with truncate=false under multi-latent attention: megatron's MLA always "
                        "rounds the correction range")
