"""Runs under megatron-core's activation recomputation (--recompute) dump what runs without it dump:
each tensor once, under its own name, its gradient in its forward call's place (capture/recompute.py)."""

from __future__ import annotations

import pytest
from conftest import error_line, invoke

import megalign
from megalign.compare.sources import open_source


def names(path) -> list[tuple[str, str]]:
    return sorted((entry.kind, entry.name) for entry in open_source(path).entries)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_a_recomputed_backward_records_each_tensor_once_and_agrees_with_the_plain_one(dump, recompute):
    plain, recomputed = dump("backward"), dump("backward", "--recompute", recompute)
    assert megalign.open(recomputed).meta["recompute"] == recompute and "recompute" not in megalign.open(plain).meta
    assert names(recomputed) == names(plain)  # no layer's activations again as `name@1`
    result = invoke("compare", plain, recomputed)
    assert result.exit_code == 0, result.output
    assert "86 compared, 86 passed, 0 failed\n" in result.output


def test_a_recomputation_that_computes_otherwise_fails_at_the_first_gradient_it_moves(dump, tmp_path, monkeypatch):
    """The twin: layer 1's core attention scaled by 1.001 in its recomputed forward only. Its activations,
    recorded in the first forward, agree; the first gradient backward takes through it does not."""
    monkeypatch.setenv("MEGALIGN_FAULT", "recompute-differs@1")
    assert invoke("backward", "--recompute", "full", "--out", tmp_path / "bug").exit_code == 0
    assert names(tmp_path / "bug") == names(dump("backward"))
    result = invoke("compare", dump("backward"), tmp_path / "bug")
    assert result.exit_code == 1, result.output
    assert ("first divergence: activation_grad decoder.layers.1.self_attention.core_attention.scale_mask_softmax\n"
            in result.output), result.output
    assert "FAIL" not in "".join(line for line in result.output.splitlines() if " activation " in line)


@pytest.mark.parametrize("args, said", [
    (("forward",), "--recompute full recomputes activations in backward: it needs backward, not forward"),
    (("backward", "--stack", "hf", "--hf", ".cache/smollm2-135m"),
     "--recompute full is megatron-core's activation recomputation: it needs --stack megatron"),
])
def test_recompute_outside_megatrons_training_is_refused_in_one_line(tmp_path, args, said):
    result = invoke(*args, "--recompute", "full", "--out", tmp_path / "out")
    assert result.exit_code == 2 and error_line(result) == f"error: {said}"
