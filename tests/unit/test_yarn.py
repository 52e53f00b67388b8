"""YaRN as transformers computes it (_compute_yarn_parameters, and MLA's softmax scale) and as megatron-core
does from the settings megalign maps a config.json to: the frequencies and the attention factor of every
family that takes it, and the configs refused where megatron computes something else.

GPT-OSS's YaRN is also compared end to end (tests/stacks/test_cross_stack_gptoss.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from megalign.errors import UserError
from megalign.stacks.hf.families import FAMILIES, model_config

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=1024)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256)
MLA = dict(n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=32,
           kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8)


def raw_config(model_type: str, rope: dict, **extra) -> dict:
    architecture = FAMILIES[model_type].architecture
    return {"model_type": model_type, "architectures": [architecture], **SIZES, **extra, "rope_parameters": rope}


def transformers_yarn(raw: dict) -> tuple[torch.Tensor, float, float]:
    """(inverse frequencies, attention factor, MLA's softmax scale multiplier: 1 elsewhere)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    config = transformers.AutoConfig.for_model(**raw)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scale = yarn_apply_mscale(config.rope_parameters, 1.0) if raw["model_type"] == "deepseek_v3" else 1.0
    return inv_freq, factor, scale


def megatron_yarn(raw: dict, monkeypatch) -> tuple[torch.Tensor, float, float]:
    """The same from megatron-core's YarnRotaryEmbedding, built as GPTModel (or MLA) builds it from the
    settings megalign gives it (stacks/megatron/model.py)."""
    from megalign.stacks.megatron.cpu_patches import install_import_stubs

    install_import_stubs()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # get_emb moves its tables there
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (YarnRotaryEmbedding,
                                                                                  _yarn_get_mscale)

    from megalign.stacks.megatron.model import _mla_config, _yarn

    model = model_config(raw, FAMILIES[raw["model_type"]], "m", "config.json")
    settings = _mla_config(model) if model.multi_latent_attention else _yarn(model)
    dim = model.qk_pos_emb_head_dim if model.multi_latent_attention else model.kv_channels
    embedding = YarnRotaryEmbedding(
        dim, rotary_base=model.rotary_base, use_cpu_initialization=True,
        scaling_factor=settings["rotary_scaling_factor"],
        original_max_position_embeddings=settings["original_max_position_embeddings"],
        beta_fast=settings["beta_fast"], beta_slow=settings["beta_slow"], mscale=settings["mscale"],
        mscale_all_dim=settings["mscale_all_dim"],
        correction_range_round_to_int=settings.get("correction_range_round_to_int", True))
    emb, factor = embedding.get_emb(2)
    scale = _yarn_get_mscale(settings["rotary_scaling_factor"], settings["mscale_all_dim"]) ** 2 \
        if model.multi_latent_attention else 1.0
    return emb[1, 0, 0, :dim // 2], factor, scale


CASES = {
    "llama": raw_config("llama", YARN),
    "llama-truncate-false": raw_config("llama", {**YARN, "truncate": False}),
    "llama-mscale-only": raw_config("llama", {**YARN, "mscale": 0.707}),
    "qwen2-mscale-ratio": raw_config("qwen2", {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "qwen3-beta": raw_config("qwen3", {**YARN, "beta_fast": 16.0, "beta_slow": 2.0}, head_dim=16),
    "gpt-oss": raw_config("gpt_oss", {**YARN, "truncate": False}, **GPT_OSS),
    "deepseek-v3": raw_config("deepseek_v3", YARN, **MLA),
    "deepseek-v3-mscale": raw_config("deepseek_v3", {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}, **MLA),
    "deepseek-v3-mscale-all-dim-only": raw_config("deepseek_v3", {**YARN, "mscale_all_dim": 1.0}, **MLA),
}


@pytest.mark.parametrize("name", CASES)
def test_megatron_computes_transformers_yarn(name, monkeypatch):
    inv_freq, factor, scale = transformers_yarn(CASES[name])
    ours, our_factor, our_scale = megatron_yarn(CASES[name], monkeypatch)
    assert torch.allclose(ours, inv_freq, rtol=1e-6, atol=0), (ours, inv_freq)
    assert math.isclose(our_factor, factor, rel_tol=1e-9), (our_factor, factor)
    assert math.isclose(our_scale, scale, rel_tol=1e-9), (our_scale, scale)


def test_a_published_bridge_s_mscale_for_gpt_oss_is_another_attention_factor(monkeypatch):
    """mscale = mscale_all_dim = 1.0 on GPT-OSS: factor 1, where transformers' unset ones give 0.1 ln 4 + 1."""
    unset = megatron_yarn(CASES["gpt-oss"], monkeypatch)[1]
    set_to_one = megatron_yarn(raw_config("gpt_oss", {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, **GPT_OSS),
                               monkeypatch)[1]
    assert (unset, set_to_one) == (pytest.approx(0.1 * math.log(4) + 1), 1.0)


@pytest.mark.parametrize("raw, message", [
    (raw_config("llama", {**YARN, "attention_factor": 1.0}), "YaRN attention_factor=1.0: megatron derives it"),
    (raw_config("llama", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "RoPE scaling 'llama3'"),
    (raw_config("deepseek_v3", {**YARN, "truncate": False}, **MLA), "YaRN with truncate=false under multi-latent"),
    (raw_config("glm4_moe", {**YARN, "partial_rotary_factor": 0.5}, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32), "YaRN with partial_rotary_factor=0.5"),
], ids=["attention-factor", "llama3", "mla-truncate-false", "partial-rotary"])
def test_yarn_megatron_computes_otherwise_is_refused(raw, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        model_config(raw, FAMILIES[raw["model_type"]], "m", "config.json")
