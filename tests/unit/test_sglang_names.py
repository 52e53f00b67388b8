"""sglang's module names (as its dumper's hooks write them, read by sglang.logical_name) in megalign's names:
the rows no end-to-end test reaches (DeepSeek-V3 without q_lora_rank, GPT-OSS's router) beside one of each
kind the others check."""

from __future__ import annotations

import pytest

from megalign.compare.sources.sglang import logical_name
from megalign.compare.sources.sglang_names import Target, megatron_name
from megalign.dump.format import Kind

SA, M = "decoder.layers.3.self_attention", "decoder.layers.3.mlp"
CASES = [
    # DeepSeek-V3 with q_lora_rank null (deepseek_v2.py:2087-2100): q_proj and kv_a_proj_with_mqa apart.
    ("model.layers.3.self_attn.q_proj.output", Target(f"{SA}.linear_q_proj")),
    ("model.layers.3.self_attn.kv_a_proj_with_mqa.output", Target(f"{SA}.linear_kv_down_proj")),
    # With q_lora_rank (deepseek_v2.py:2070): the fused projection's tail past q_a_layernorm's width.
    ("model.layers.3.self_attn.fused_qkv_a_proj_with_mqa.output",
     Target(f"{SA}.linear_kv_down_proj", after="model.layers.3.self_attn.q_a_layernorm")),
    ("model.layers.3.self_attn.q_a_layernorm.inputs.0", Target(f"{SA}.linear_q_down_proj")),
    ("model.layers.3.self_attn.kv_b_proj.output", None),  # MHA passes only
    # GPT-OSS's router (gpt_oss.py:257), DeepSeek's and GLM's gate: the router logits.
    ("model.layers.3.mlp.router.output", Target(f"{M}.router.logits", Kind.ROUTING)),
    ("model.layers.3.mlp.gate.output", Target(f"{M}.router.logits", Kind.ROUTING)),
    ("model.layers.3.mlp.topk.output.1",
     Target(f"{M}.router.experts", Kind.ROUTING, weights="model.layers.3.mlp.topk")),
    ("model.layers.3.mlp.topk.output.0", None),  # the weights: routed_scaling_factor in them or not
    ("model.layers.3.mlp.experts.output", None),
    ("model.layers.3.mlp.shared_experts.down_proj.output", Target(f"{M}.shared_experts.linear_fc2")),
    ("model.layers.3.output.1", Target("decoder.layers.3", summed=True)),
    ("model.layers.3.post_attention_layernorm.output.1", None),  # a norm's residual
]


@pytest.mark.parametrize("dumped,target", CASES, ids=[c[0] for c in CASES])
def test_sglang_module_names_map_onto_megalign_records(dumped, target):
    assert megatron_name(logical_name("non_intrusive__" + dumped)[1]) == target
