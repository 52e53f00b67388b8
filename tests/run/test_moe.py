"""Mixture of experts: megatron-core's MoE layer under expert parallelism, against the single-rank run.

Real workers on gloo, configs/tiny-moe.yaml (4 experts, top-2). Every tensor agrees within the fp32
tolerance, routing included (every token keeps its experts and their order), with both token
dispatchers, EP=2 with TP=2 (expert TP 2) and EP=2 with CP=2. The failing twins: layer 1's router
perturbed in the weights (MEGALIGN_FAULT, reported as a routing flip at that layer), a bf16 run
whose routing only replay makes equal; two swapped experts are planted in a checkpoint
(tests/stacks/test_cross_stack_moe.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import invoke, max_abs_diffs, tensors
from test_run_layouts import TOLERANCE

MOE = ("backward", "--config", "configs/tiny-moe.yaml")
# embedding, final norm, output layer; per layer 2 norms, qkv, proj, the router and 4 experts x 2 linears
MOE_PARAMETERS = 3 + 2 * (4 + 1 + 4 * 2)
LAYOUTS = {
    "ep2-alltoall": ("--ep", "2"),
    "ep2-tp2-sp": ("--ep", "2", "--tp", "2", "--sp"),
    "ep2-cp2-allgather": ("--ep", "2", "--cp", "2", "--moe-dispatcher", "allgather"),
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
    result = invoke(*MOE, "--out", out)
    assert result.exit_code == 0, result.output
    return out


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


def order_agreement(output: str) -> list[str]:
    return [line.split("keep their top-k set, ")[1].split()[0] for line in output.splitlines()
            if ".mlp.router.experts" in line]


def test_replay_gives_a_bf16_run_the_fp32_routing(dump, tmp_path):
    """bf16 alone reorders some tokens' experts in layer 1; replaying the fp32 run's choices (ids and
    weights) makes them identical, at another layout (EP=2) and with the batch packed over CP=2."""
    fp32 = dump(*MOE)
    alone = invoke("compare", fp32, dump(*MOE, "--dtype", "bf16"))
    assert order_agreement(alone.output) != ["100.00%", "100.00%"], alone.output
    replayed = tmp_path / "replayed"
    result = invoke(*MOE, "--dtype", "bf16", "--ep", "2", "--packed", "--cp", "2", "--routing", f"replay:{fp32}",
                    "--out", replayed)
    assert result.exit_code == 0, result.output
    compared = invoke("compare", fp32, replayed)
    assert compared.exit_code == 0, compared.output
    assert order_agreement(compared.output) == ["100.00%", "100.00%"]
    assert compared.output.count("100.00% of 52 tokens keep their top-k set") == 2


@pytest.mark.parametrize("source, args, message", [
    ("dense", (), "has no recorded routing"),
    ("moe", ("--tokens", "{tmp}/other.json"), "recorded other tokens than this run's"),
    ("moe", ("--config", "{tmp}/eight.yaml"), "recorded another model: num_moe_experts 4 vs 8"),
    ("moe", ("--routing", "again"), "expected record or replay:DUMP"),
])
def test_a_replay_that_cannot_fit_is_one_line_and_exit_2(dump, tmp_path, source, args, message):
    (tmp_path / "other.json").write_text("[[1, 2, 3, 4], [5, 6, 7, 8]]")
    (tmp_path / "eight.yaml").write_text(Path("configs/tiny-moe.yaml").read_text().replace("num_moe_experts: 4",
                                                                                          "num_moe_experts: 8"))
    recorded = dump(*MOE) if source == "moe" else dump("backward")
    args = [a.format(tmp=tmp_path) for a in args]
    routing = [] if "--routing" in args else ["--routing", f"replay:{recorded}"]
    result = invoke(*MOE, *routing, *args, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert message in result.output and not (tmp_path / "out").exists()


def test_an_expert_no_token_reached_has_zeros_for_its_gradient(tmp_path):
    """Two sequences of three tokens, top-2 of 16 experts: the four tokens whose outputs the loss reads
    (a sequence's last predicts nothing) reach 8 experts of a layer at most, so at least 8 have a
    gradient of zeros, not a missing one: the backward runs, and EP=2 agrees with EP=1 on them. The
    failing twin: reading `.grad` under DDP (None everywhere) still names every other parameter, the
    experts that tokens reached included."""
    (tmp_path / "many.yaml").write_text(Path("configs/tiny-moe.yaml").read_text().replace("num_moe_experts: 4",
                                                                                         "num_moe_experts: 16"))
    (tmp_path / "few.json").write_text("[[5, 17, 29], [3, 9, 40]]")
    few = ("backward", "--config", tmp_path / "many.yaml", "--tokens", tmp_path / "few.json")
    for name, args in (("ep1", ()), ("ep2", ("--ep", "2"))):
        result = invoke(*few, *args, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
    grads = {name: grad for (kind, name), grad in tensors(tmp_path / "ep1").items() if kind == "param_grad"}
    assert len(grads) == 3 + 2 * (4 + 1 + 16 * 2)
    idle = {name.split(".linear_")[0] for name, grad in grads.items() if ".experts." in name and not grad.any()}
    for layer in (0, 1):
        assert 8 <= sum(f"layers.{layer}." in expert for expert in idle) <= 14
    manifest = json.loads((tmp_path / "ep1" / "rank-00000" / "manifest.json").read_text())
    assert manifest["grad_coverage"]["zeros_of_unreached_experts"] == 2 * len(idle)  # fc1 and fc2 weights
    compared = invoke("compare", tmp_path / "ep1", tmp_path / "ep2")
    assert compared.exit_code == 0, compared.output

    result = invoke(*few, "--grad-source", "grad", "--out", tmp_path / "grad")
    assert result.exit_code == 1
    # Each idle expert's two linears have no bias in tiny-moe: 2 parameters an expert are excused, no more.
    assert f"{len(grads) - 2 * len(idle)} of {len(grads)} parameters have no gradient (read from grad)" \
        in result.output, result.output


def test_gpt_oss_at_tp2_agrees_but_where_megatron_sums_the_expert_biases_twice(dump, tmp_path):
    """configs/tiny-gpt-oss.yaml at TP=2 (SP, expert TP 1) against TP=1. The sinks, which megatron-core
    splits by heads without marking the split (megatron_params.split_by_name_only), agree, and so does
    every tensor but one kind: the experts' linear_fc2 bias gradients, exactly twice TP=1's. megatron-core
    (0.19) marks a RowParallelLinear's bias `sequence_parallel` under SP, an expert's too, so
    finalize_model_grads sums it over the TP ranks after DDP summed it over the expert data-parallel
    ranks: at EP=1 the same two ranks. The first divergence is named at layer 0's expert 0. Biased
    experts at expert TP 2 are refused (test_cross_stack_gptoss.py)."""
    gpt_oss = ("backward", "--config", "configs/tiny-gpt-oss.yaml")
    out = tmp_path / "report.jsonl"
    result = invoke("compare", dump(*gpt_oss), dump(*gpt_oss, "--tp", "2", "--sp", "--etp", "1"), "--json", out)
    assert result.exit_code == 1, result.output
    assert "first divergence: param_grad decoder.layers.0.mlp.experts.0.linear_fc2.bias" in result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [r for r in records if r["record"] == "tensor"]
    failed = {r["name"]: r for r in rows if r["status"] != "pass"}
    assert set(failed) == {f"decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.bias"
                           for layer in (0, 1) for expert in range(4)}
    for record in failed.values():
        a, b = record["metrics"]["norm_a"], record["metrics"]["norm_b"]
        assert record["kind"] == "param_grad" and b == pytest.approx(2 * a, rel=1e-5)
    sinks = [r for r in rows if r["name"].endswith("core_attention.softmax_offset")]
    assert len(sinks) == 2 and all(r["status"] == "pass" and r["shape_b"] == [4] for r in sinks)


def test_glm_shaped_config_at_ep2_matches_the_single_rank_run(dump):
    """configs/tiny-glm-moe.yaml: a dense layer 0, then sigmoid routing with expert bias and a shared expert."""
    glm = ("backward", "--config", "configs/tiny-glm-moe.yaml")
    single, other = dump(*glm), dump(*glm, "--ep", "2")
    diffs = max_abs_diffs(single, other)
    assert not {key: d for key, d in diffs.items() if d > TOLERANCE}
    grads = {name for kind, name in diffs if kind == "param_grad"}
    assert {"decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
            "decoder.layers.1.mlp.experts.3.linear_fc2.weight"} <= grads
    assert not any(name.startswith("decoder.layers.0.mlp.router") for kind, name in diffs if kind == "routing")
    result = invoke("compare", single, other)
    assert result.exit_code == 0, result.output
    assert result.output.count("100.00% of 64 tokens keep their top-k set, 100.00% its order") == 1
