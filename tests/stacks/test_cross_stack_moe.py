"""Mixture-of-experts checkpoints through transformers and through megatron-core, compared.

Tiny random Qwen3-MoE, Mixtral and GLM-4.5 checkpoints built with transformers on the fly (4 experts,
top-2; norm weights randomised; GLM's layer 0 dense, its router decisive: see decisive_router).
transformers 5 keeps the experts fused in memory and per expert on disk; both are mapped to megatron's
experts by global index (compared at EP=2; the twin runs at EP=1). The failing twin is a checkpoint
whose experts 0 and 1 of layer 1 trade weights: caught at that layer's MoE output, routing still
equal; GLM's, its router's expert bias dropped: caught at layer 1's routing. An sglang server's dump of the GLM
model, by sglang's module names, lines up with megatron's run.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from conftest import invoke, max_abs_diffs
from planted import drop_expert_bias, swap_experts, with_config
from test_cross_stack import build_checkpoint
from test_cross_stack_deepseek import compare_rows, sglang_server

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, num_experts_per_tok=2)
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 96,
                                                            "head_dim": 16, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    # qkv biases, qk-norm, half the head's channels rotated, a shared expert, scores scaled by 1.5.
    "glm4-moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {"n_routed_experts": 4, "moe_intermediate_size": 32,
                                                         "head_dim": 16, "attention_bias": True, "use_qk_norm": True,
                                                         "first_k_dense_replace": 1, "routed_scaling_factor": 1.5}),
}
# embedding, final norm, output layer; per layer 2 norms, qkv, proj, router, 4 experts x 2 (+2 qk norms for Qwen3)
# GLM: layer 0 dense (2 norms, qkv weight and bias, 2 qk norms, proj, fc1, fc2), layer 1 that plus router,
# 4 experts x 2 and the shared expert's 2 in place of fc1, fc2.
MEGATRON_PARAMS = {"qwen3-moe": 3 + 2 * 15, "mixtral": 3 + 2 * 13, "glm4-moe": 3 + 9 + 18}
MOE_LAYERS = {"qwen3-moe": 2, "mixtral": 2, "glm4-moe": 1}
LAYOUTS = [("qwen3-moe", ("--ep", "2")), ("mixtral", ("--ep", "2")), ("glm4-moe", ()), ("glm4-moe", ("--ep", "2")),
           ("glm4-moe", ("--cp", "2"))]


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe")
    made = {}
    for family in FAMILIES:
        made[family] = build_checkpoint(family, root / family, FAMILIES, TINY)
        made[f"{family}-swapped"] = swap_experts(root / family, root / f"{family}-swapped", layer=1)
    decisive_router(made["glm4-moe"])
    made["glm4-moe-unbiased"] = drop_expert_bias(root / "glm4-moe", root / "glm4-moe-unbiased")
    return made


def decisive_router(path):
    """GLM's router weights times 10 and its e_score_correction_bias (zeros as built) drawn: a tiny random
    router's sigmoid scores all lie near 0.5, where bf16 rounding alone flips choices; the bias must move some."""
    weights = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if name.endswith(".mlp.gate.weight"):
            tensor.mul_(10.0)
        elif name.endswith(".e_score_correction_bias"):
            tensor.normal_(0.0, 0.1, generator=generator)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("family,layout", LAYOUTS, ids=[f"{f}-{'-'.join(l) or 'ep1'}" for f, l in LAYOUTS])
def test_megatron_matches_transformers_on_an_moe_checkpoint(dump, moe_checkpoints, family, layout):
    hf = dump("backward", "--hf", moe_checkpoints[family], "--stack", "hf")
    megatron = dump("backward", "--hf", moe_checkpoints[family], *layout)
    result = invoke("compare", hf, megatron)
    assert result.exit_code == 0, result.output
    assert result.output.count("100.00% of 64 tokens keep their top-k set, 100.00% its order") == MOE_LAYERS[family]
    diffs = max_abs_diffs(hf, megatron)
    grads = {name: d for (kind, name), d in diffs.items() if kind == "param_grad"}
    assert len(grads) == MEGATRON_PARAMS[family], sorted(grads)
    assert "decoder.layers.1.mlp.experts.3.linear_fc1.weight" in grads and max(grads.values()) < 1e-5
    assert {("routing", f"decoder.layers.1.mlp.router.{w}") for w in ("logits", "experts", "weights")} <= set(diffs)
    assert diffs["activation", "decoder.layers.1.mlp"] < 1e-5 and diffs["logits", "logits"] < 1e-4


def test_swapped_experts_in_a_checkpoint_are_caught_at_their_layer(dump, moe_checkpoints):
    hf = dump("backward", "--hf", moe_checkpoints["qwen3-moe"], "--stack", "hf")
    result = invoke("compare", hf, dump("backward", "--hf", moe_checkpoints["qwen3-moe-swapped"]))
    assert result.exit_code == 1, result.output
    assert "first divergence: activation decoder.layers.1.mlp" in result.output
    assert "routing flip" not in result.output
    assert result.output.count("100.00% of 64 tokens keep their top-k set") == 2


def test_glm_expert_bias_dropped_is_caught_at_its_router(dump, moe_checkpoints):
    """The failing twin of GLM's pair: the router's e_score_correction_bias (a buffer, which a loader of
    parameters alone drops) left at zeros on the HF side. The choice moves; first seen at layer 1's routing."""
    hf = dump("backward", "--hf", moe_checkpoints["glm4-moe-unbiased"], "--stack", "hf")
    result = invoke("compare", hf, dump("backward", "--hf", moe_checkpoints["glm4-moe"]))
    assert result.exit_code == 1, result.output
    assert "first divergence: routing decoder.layers.1.mlp.router.experts" in result.output
    assert "routing flip: decoder.layers.1.mlp.router.experts" in result.output


@pytest.mark.parametrize("stack", ["megatron", "hf"])
def test_glm_settings_megatron_computes_otherwise_are_refused(moe_checkpoints, tmp_path, stack):
    glm = moe_checkpoints["glm4-moe"]
    cases = [({"norm_topk_prob": False}, "norm_topk_prob=false with sigmoid scores"),
             ({"n_group": 2, "topk_group": 2}, "num_experts_per_tok // topk_group = 2 // 2 != 2")]
    for i, (changes, message) in enumerate(cases):
        result = invoke("forward", "--hf", with_config(glm, tmp_path / f"c{i}", **changes), "--stack", stack,
                        "--out", tmp_path / f"out{i}")
        assert result.exit_code == 2 and message in result.output, (changes, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_glm_bf16_pair_passes(dump, moe_checkpoints):
    """bf16 on both stacks: transformers keeps GLM's router in float32, and so does megatron's (moe_router_dtype)."""
    hf = dump("backward", "--hf", moe_checkpoints["glm4-moe"], "--stack", "hf", "--dtype", "bf16")
    result = invoke("compare", hf, dump("backward", "--hf", moe_checkpoints["glm4-moe"], "--dtype", "bf16"))
    assert result.exit_code == 0, result.output
    assert "100.00% of 64 tokens keep their top-k set, 100.00% its order" in result.output


def test_glm_sglang_server_dump_lines_up_with_megatron_by_sglang_module_names(dump, moe_checkpoints, tmp_path):
    """GLM-4.5's sglang names (glm4_moe.py: the gate's logits, topk's ids, the shared experts, the dense MLP
    of layer 0) against megatron-core's run: exit 0. sglang's q|k|v qkv_proj is one-sided, as for Llama."""
    server = sglang_server(dump("backward", "--hf", moe_checkpoints["glm4-moe"], "--stack", "hf"), tmp_path / "sglang")
    result, rows = compare_rows(server["plain"], dump("backward", "--hf", moe_checkpoints["glm4-moe"]),
                                tmp_path / "r.jsonl")
    assert result.exit_code == 0, result.output
    passed = {name for name, row in rows.items() if row["status"] == "pass"}
    router = "decoder.layers.1.mlp.router"
    assert {f"{router}.logits", f"{router}.experts", "decoder.layers.1.mlp.shared_experts.linear_fc1",
            "decoder.layers.1.mlp", "decoder.layers.0.mlp.linear_fc2#input", "logits"} <= passed
    assert rows["decoder.layers.0.self_attention.linear_qkv"]["status"] == "only_b"
