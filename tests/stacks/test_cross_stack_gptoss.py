"""GPT-OSS checkpoints through transformers and through megatron-core, compared.

A tiny random checkpoint saved by transformers' GptOssForCausalLM: layer 0 sliding-window attention
(window 8 over 32 tokens), layer 1 full, both with sinks; 4 biased experts, top-2, behind a biased
router; YaRN (factor 4, truncate false). The biases and sinks are drawn away from their zero and small
initial values, so that a bias or sink mapped wrong shows.

Twins, each a copy of the checkpoint whose config the megatron side reads with one setting a converter
gets wrong (as the DeepSeek rope_interleave twin): the window off by one ((W, 0), as a published bridge's
provider defaults to) and YaRN's mscale and mscale_all_dim set to 1.0 (attention factor 1, as that provider
sets them). Both are first seen at layer 0's core attention, the first output the rotated and masked
scores reach.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import invoke, max_abs_diffs
from planted import with_config

WINDOW = 8
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64)
TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=WINDOW, rope_parameters=YARN)
# embedding, final norm, output layer; per layer: 2 norms, qkv and proj (weight and bias), sinks, router (weight
# and bias), 4 experts x fc1 and fc2 (weight and bias).
MEGATRON_PARAMS = 3 + 2 * (2 + 4 + 1 + 2 + 16)


def build_gpt_oss(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("router.bias"):
                param.normal_(0.0, 0.05)  # larger, it would send every token to the same experts
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
            elif name.endswith("router.weight"):
                param.normal_(0.0, 0.3)
            elif ".experts." in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-gpt-oss")
    plain = build_gpt_oss(root / "plain")
    return {"plain": plain,
            "window-off-by-one": with_config(plain, root / "window", sliding_window=WINDOW + 1),
            "yarn-mscale-1": with_config(plain, root / "mscale",
                                         rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})}


@pytest.fixture(scope="session")
def reference(dump, gpt_oss):
    """transformers' run of the plain checkpoint: the side every comparison here is made against."""
    return dump("backward", "--hf", gpt_oss["plain"], "--stack", "hf")


LAYOUTS = [(), ("--ep", "2")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(l) or "tp1" for l in LAYOUTS])
def test_megatron_matches_transformers_on_gpt_oss(dump, gpt_oss, reference, layout):
    megatron = dump("backward", "--hf", gpt_oss["plain"], *layout)
    result = invoke("compare", reference, megatron)
    assert result.exit_code == 0, result.output
    assert "100.00% of 64 tokens keep their top-k set, 100.00% its order" in result.output
    diffs = max_abs_diffs(reference, megatron)
    grads = {name: d for (kind, name), d in diffs.items() if kind == "param_grad"}
    assert len(grads) == MEGATRON_PARAMS, sorted(grads)
    assert max(grads.values()) < 1e-6, grads
    for layer in (0, 1):
        for name in ("self_attention.core_attention", "self_attention.linear_proj", "self_attention.linear_proj#1",
                     "mlp"):
            assert diffs["activation", f"decoder.layers.{layer}.{name}"] < 1e-5, name
    assert diffs["logits", "logits"] < 1e-4


def test_bf16_gpt_oss_passes(dump, gpt_oss):
    hf = dump("backward", "--hf", gpt_oss["plain"], "--stack", "hf", "--dtype", "bf16")
    result = invoke("compare", hf, dump("backward", "--hf", gpt_oss["plain"], "--dtype", "bf16"))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("twin", ["window-off-by-one", "yarn-mscale-1"])
def test_twin_is_caught_at_layer_0_core_attention(dump, gpt_oss, reference, twin):
    result = invoke("compare", reference, dump("backward", "--hf", gpt_oss[twin]))
    assert result.exit_code == 1, result.output
    assert "first divergence: activation decoder.layers.0.self_attention.core_attention" in result.output


def test_refused_gpt_oss_settings_are_one_line_exit_2(gpt_oss, tmp_path):
    plain = gpt_oss["plain"]
    cases = [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantized weights (mxfp4) are not read"),
        ({"swiglu_alpha": 1.5}, "megatron's quick_gelu is x * sigmoid(1.702 x)"),
        ({"attention_bias": False}, "attention_bias=false leaves the attention unbiased"),
        ({"rope_parameters": {**YARN, "attention_factor": 1.0}}, "YaRN attention_factor=1.0"),
    ]
    for i, (changes, message) in enumerate(cases):
        result = invoke("forward", "--hf", with_config(plain, tmp_path / str(i), **changes), "--out", tmp_path / "o")
        assert result.exit_code == 2 and message in result.output, (changes, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    for layout, message in ((("--tp", "2", "--sp"), "--etp 2 (the default is --tp) with biased experts"),
                            (("--cp", "2"), "--cp 2 with attention sinks or a sliding window"),
                            (("--packed",), "--packed with attention sinks or a sliding window")):
        result = invoke("forward", "--hf", plain, *layout, "--out", tmp_path / "o")
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_the_shipped_tiny_config_is_this_checkpoints_model():
    """configs/tiny-gpt-oss.yaml is what --hf reads from the checkpoint above, but for its wider weights."""
    import dataclasses

    import transformers

    from megalign.spec import ModelConfig
    from megalign.stacks.hf.families import family_of, model_config

    raw = transformers.GptOssConfig(**TINY).to_dict()
    mapped = model_config(raw, family_of(raw, "tiny"), "tiny-gpt-oss", "tiny")
    shipped = ModelConfig.from_yaml(Path(__file__).parents[2] / "configs" / "tiny-gpt-oss.yaml")
    assert dataclasses.replace(shipped, init_method_std=mapped.init_method_std) == mapped
