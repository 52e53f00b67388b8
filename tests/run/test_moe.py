"""Mixture of experts: megatron-core's MoE layer under expert parallelism, against the single-rank run.

Real workers on gloo, configs/tiny-moe.yaml (4 experts, top-2). Every tensor agrees within the fp32
tolerance, routing included (every token keeps its experts and their order), with both token
dispatchers, EP=2 with TP=2 (expert TP 2 and 1) and EP=2 with CP=2. The failing twins are planted
in the weights (MEGALIGN_FAULT): two experts swapped in layer 1 (caught at that layer's MoE output,
routing still equal), and layer 1's router perturbed (reported as a routing flip at that layer).
"""

from __future__ import annotations

import pytest
from conftest import invoke, max_abs_diffs
from test_run_layouts import TOLERANCE

MOE = ("backward", "--config", "configs/tiny-moe.yaml")
# embedding, final norm, output layer; per layer 2 norms, qkv, proj, the router and 4 experts x 2 linears
MOE_PARAMETERS = 3 + 2 * (4 + 1 + 4 * 2)
LAYOUTS = {
    "ep2-alltoall": ("--ep", "2"),
    "ep2-allgather": ("--ep", "2", "--moe-dispatcher", "allgather"),
    "ep2-tp2-sp": ("--ep", "2", "--tp", "2", "--sp"),
    "ep2-tp2-sp-etp1": ("--ep", "2", "--tp", "2", "--sp", "--etp", "1"),
    "ep2-cp2": ("--ep", "2", "--cp", "2"),
}
ROUTERS = [f"decoder.layers.{layer}.mlp.router.{what}" for layer in (0, 1) for what in ("logits", "experts", "weights")]




@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_expert_parallel_layout_matches_the_single_rank_run(dump, layout):
    single, other = dump(*MOE), dump(*MOE, *LAYOUTS[layout])
    diffs = max_abs_diffs(single, other)
    assert not {key: d for key, d in diffs.items() if d > TOLERANCE}
    assert sum(kind == "param_grad" for kind, _ in diffs) == MOE_PARAMETERS
    assert {("routing", name) for name in ROUTERS} <= set(diffs)
    assert ("activation", "decoder.layers.1.mlp") in diffs and ("loss", "loss") in diffs
    result = invoke("compare", single, other)
    assert result.exit_code == 0, result.output
    assert result.output.count("100.00% of 64 tokens keep their top-k set, 100.00% its order") == 2  # both layers


def planted(tmp_path, monkeypatch, fault: str):
    monkeypatch.setenv("MEGALIGN_FAULT", fault)
    out = tmp_path / fault
    result = invoke(*MOE, "--ep", "2", "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_swapped_experts_are_caught_at_their_layer_with_routing_equal(dump, tmp_path, monkeypatch):
    result = invoke("compare", dump(*MOE), planted(tmp_path, monkeypatch, "swap-experts@1"))
    assert result.exit_code == 1, result.output
    assert "first divergence: activation decoder.layers.1.mlp" in result.output
    assert "routing flip" not in result.output
    assert result.output.count("100.00% of 64 tokens keep their top-k set") == 2


def test_a_perturbed_router_is_reported_as_a_routing_flip_at_its_layer(dump, tmp_path, monkeypatch):
    result = invoke("compare", dump(*MOE), planted(tmp_path, monkeypatch, "perturb-router@1"))
    assert result.exit_code == 1, result.output
    assert "routing flip: decoder.layers.1.mlp.router.experts" in result.output
    assert "first divergence: routing decoder.layers.1.mlp.router.logits" in result.output
    layer0 = next(line for line in result.output.splitlines() if "decoder.layers.0.mlp.router.experts" in line)
    assert "PASS" in layer0 and "100.00% of 64 tokens keep their top-k set" in layer0


@pytest.mark.parametrize("args, message", [
    (("--ep", "3"), "--ep 3 does not divide num_moe_experts=4"),
    (("--tp", "2"), "needs --sp"),
    (("--ep", "2", "--tp", "2", "--sp", "--etp", "3"), "--etp 3: megalign runs expert tensor parallelism of 1 or --tp"),
    (("--ep", "2", "--dp", "1"), "pass --dp 2"),
])
def test_bad_expert_layouts_are_one_line_and_exit_2(tmp_path, args, message):
    result = invoke(*MOE, *args, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert message in result.output and not (tmp_path / "out").exists()


def test_expert_parallelism_needs_experts(tmp_path):
    result = invoke("backward", "--ep", "2", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "has none (set num_moe_experts)" in result.output
