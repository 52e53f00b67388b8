"""The architectures megalign maps between transformers and megatron-core, one table per family.

A `Rule` names a megatron module and the HF module(s) it is made of, `{i}` standing for the layer
index. The same table gives the weights (`<module>.weight` / `.bias`), the parameter gradients and
the module outputs: see namemap.py for how the parts are joined.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from megalign.alignment.errors import UserError
from megalign.alignment.spec import ModelConfig

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

    def expand(self, layer: int) -> "Rule":
        return replace(self, megatron=self.megatron.format(i=layer), hf=tuple(h.format(i=layer) for h in self.hf))

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron


_L = "model.layers.{i}"
_M = "decoder.layers.{i}"


def _decoder_rules(qk_norm: bool = False) -> tuple[Rule, ...]:
    """The Llama layout, layer by layer in execution order; `qk_norm`: Qwen3's RMSNorm over head_dim
    on each query and key head, before RoPE."""
    return (
        # megatron's `embedding` output is the lookup made sequence-first, the layout of every layer output.
        Rule("embedding.word_embeddings", ("model.embed_tokens",), activation="embedding"),
        Rule(f"{_M}.input_layernorm", (f"{_L}.input_layernorm",)),
        Rule(f"{_M}.self_attention.linear_qkv",
             (f"{_L}.self_attn.q_proj", f"{_L}.self_attn.k_proj", f"{_L}.self_attn.v_proj"), join="qkv"),
        *((Rule(f"{_M}.self_attention.q_layernorm", (f"{_L}.self_attn.q_norm",)),
           Rule(f"{_M}.self_attention.k_layernorm", (f"{_L}.self_attn.k_norm",))) if qk_norm else ()),
        # The attention output before the output projection: megatron's core_attention module, o_proj's input.
        Rule(f"{_M}.self_attention.core_attention", (f"{_L}.self_attn.o_proj",), params=False, on="input"),
        Rule(f"{_M}.self_attention.linear_proj", (f"{_L}.self_attn.o_proj",)),
        Rule(f"{_M}.self_attention", (f"{_L}.self_attn",), params=False),
        Rule(f"{_M}.pre_mlp_layernorm", (f"{_L}.post_attention_layernorm",)),
        Rule(f"{_M}.mlp.linear_fc1", (f"{_L}.mlp.gate_proj", f"{_L}.mlp.up_proj"), join="cat"),
        # SwiGLU's output, act(gate) * up: a bare function in both stacks, so the down projection's input.
        Rule(f"{_M}.mlp.linear_fc2#input", (f"{_L}.mlp.down_proj",), params=False, on="input"),
        Rule(f"{_M}.mlp.linear_fc2", (f"{_L}.mlp.down_proj",)),
        Rule(f"{_M}.mlp", (f"{_L}.mlp",), params=False),
        Rule(_M, (_L,), params=False),
        Rule("decoder.final_layernorm", ("model.norm",)),
        Rule("output_layer", ("lm_head",), activation=None),
    )


LLAMA_RULES = _decoder_rules()
# Qwen2 is Llama with biases on q/k/v: megatron's add_qkv_bias, grouped like the weight (namemap.py).
QWEN2_RULES = LLAMA_RULES
QWEN3_RULES = _decoder_rules(qk_norm=True)


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    rules: tuple[Rule, ...]
    config: Callable[[dict, str], dict] = field(repr=False)  # family-specific ModelConfig fields


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


def _no_sliding_window(raw: dict, source: str) -> None:
    if raw.get("use_sliding_window"):
        raise UserError(f"{source}: use_sliding_window=true (sliding-window attention) is not supported")


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", LLAMA_RULES, _llama),
    Family("qwen2", "Qwen2ForCausalLM", QWEN2_RULES, _qwen2),
    Family("qwen3", "Qwen3ForCausalLM", QWEN3_RULES, _qwen3),
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


def _rope_theta(raw: dict, source: str) -> float:
    """transformers 5 writes rope_parameters; older checkpoints rope_theta and rope_scaling."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UserError(f"{source}: RoPE scaling {kind!r} is not supported (only plain RoPE)")
    return rope.get("rope_theta", raw.get("rope_theta", 10000.0))
