"""Mixture-of-experts checkpoints through transformers and through megatron-core, compared.

Tiny random Qwen3-MoE and Mixtral checkpoints built with transformers on the fly (4 experts,
top-2; norm weights randomised). transformers 5 keeps the experts fused in memory and per expert on
disk; both are mapped to megatron's experts by global index (compared at EP=2; the twin runs at EP=1). The failing twin is a checkpoint whose
experts 0 and 1 of layer 1 trade weights: caught at that layer's MoE output, routing still equal.
"""

from __future__ import annotations

import pytest
from conftest import invoke, max_abs_diffs
from planted import swap_experts
from test_cross_stack import build_checkpoint

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, num_experts_per_tok=2)
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 96,
                                                            "head_dim": 16, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
}
# embedding, final norm, output layer; per layer 2 norms, qkv, proj, router, 4 experts x 2 (+2 qk norms for Qwen3)
MEGATRON_PARAMS = {"qwen3-moe": 3 + 2 * 15, "mixtral": 3 + 2 * 13}
LAYOUTS = [("qwen3-moe", ("--ep", "2")), ("mixtral", ("--ep", "2"))]


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe")
    made = {}
    for family in FAMILIES:
        made[family] = build_checkpoint(family, root / family, FAMILIES, TINY)
        made[f"{family}-swapped"] = swap_experts(root / family, root / f"{family}-swapped", layer=1)
    return made


@pytest.mark.parametrize("family,layout", LAYOUTS, ids=[f"{f}-{'-'.join(l) or 'ep1'}" for f, l in LAYOUTS])
def test_megatron_matches_transformers_on_an_moe_checkpoint(dump, moe_checkpoints, family, layout):
    hf = dump("backward", "--hf", moe_checkpoints[family], "--stack", "hf")
    megatron = dump("backward", "--hf", moe_checkpoints[family], *layout)
    result = invoke("compare", hf, megatron)
    assert result.exit_code == 0, result.output
    assert result.output.count("100.00% of 64 tokens keep their top-k set, 100.00% its order") == 2
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
