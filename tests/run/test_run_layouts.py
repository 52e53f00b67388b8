"""CP, TP and PP layouts of the same model agree with the single-rank run, tensor for tensor.

Real megatron-core workers under torchrun on gloo; dumps reassembled by megalign's own reader.
fp32 on the CPU: everything must agree to 1e-5 (seen: about 1e-6 and below).
"""

from __future__ import annotations

import json

import pytest
from conftest import max_abs_diffs, tensors

TOLERANCE = 1e-5
# embedding, final norm and output layer, plus 6 per layer (2 norms, qkv, proj, fc1, fc2) in the tiny model
TINY_PARAMETERS = 3 + 2 * 6


def assert_agree(reference, other, min_activations=20):
    diffs = max_abs_diffs(reference, other)
    kinds = {kind for kind, _ in diffs}
    assert {"activation", "logits", "logprobs"} <= kinds, kinds
    assert sum(kind == "activation" for kind, _ in diffs) >= min_activations
    worst = {key: d for key, d in diffs.items() if d > TOLERANCE}
    assert not worst, worst
    return diffs


def test_cp2_backward_matches_cp1(dump):
    diffs = assert_agree(dump("backward", "--cp", "1"), dump("backward", "--cp", "2"))
    grads = [name for kind, name in diffs if kind == "param_grad"]
    assert len(grads) == TINY_PARAMETERS
    assert ("loss", "loss") in diffs
    assert sum(kind == "activation_grad" for kind, _ in diffs) >= 20


def test_cp_local_loss_norm_scales_gradients_by_about_cp(dump):
    """The failing twin: dividing by each rank's own token count is caught, about 2x at CP=2."""
    reference = tensors(dump("backward", "--cp", "1"))
    buggy = tensors(dump("backward", "--cp", "2", "--loss-norm", "local"))
    ratios = []
    for (kind, name), grad in reference.items():
        if kind == "param_grad":
            ratios.append((buggy[kind, name].norm() / grad.norm()).item())
            assert (buggy[kind, name] - grad).abs().max().item() > 100 * TOLERANCE, name
    assert len(ratios) == TINY_PARAMETERS
    assert all(1.5 < r < 2.6 for r in ratios), ratios
    assert 1.5 < (buggy["loss", "loss"] / reference["loss", "loss"]).item() < 2.6


def test_cp4_forward_matches_cp1(dump):
    diffs = assert_agree(dump("forward", "--cp", "1"), dump("forward", "--cp", "4"))
    assert not any(kind in ("param_grad", "activation_grad") for kind, _ in diffs)


def test_forward_of_a_tokens_file_with_a_config_matches_cp1(dump, tmp_path_factory):
    """README's `megalign forward --cp 2 --config configs/tiny.yaml --tokens tokens.json`: the file's
    tokens, run at CP=2, agree with one rank."""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.json"
    sequences = [[5, 7, 11, 13, 17, 19, 23, 29], [2, 3, 5, 8, 13, 21, 34, 55]]
    tokens.write_text(json.dumps(sequences))
    args = ("forward", "--config", "configs/tiny.yaml", "--tokens", str(tokens))
    cp2 = dump(*args, "--cp", "2")
    assert_agree(dump(*args, "--cp", "1"), cp2)
    assert tensors(cp2)["input", "tokens"].tolist() == sequences


def test_tp2_cp2_backward_matches_single_rank(dump):
    """TP-sharded parameter gradients (column, row, vocab and fused SwiGLU) are reassembled and compared."""
    diffs = assert_agree(dump("backward", "--cp", "1"), dump("backward", "--tp", "2", "--cp", "2"))
    grads = {name for kind, name in diffs if kind == "param_grad"}
    assert len(grads) == TINY_PARAMETERS
    assert {"decoder.layers.0.mlp.linear_fc1.weight", "embedding.word_embeddings.weight"} <= grads


def test_a_vocabulary_shard_no_token_reaches_still_has_a_gradient(dump, tmp_path):
    """Token ids all under 64 of the 128: TP rank 1's rows of the embedding get an all-zero gradient,
    which is a gradient all the same (the coverage check looks over the TP group). The check's own
    twin, a DDP run read from `.grad` that has none, fails in test_run_errors.py."""
    tokens = tmp_path / "low.json"
    tokens.write_text(json.dumps([[(7 * i + 3 * row) % 60 for i in range(16)] for row in range(2)]))
    diffs = assert_agree(dump("backward", "--tokens", tokens), dump("backward", "--tp", "2", "--tokens", tokens))
    assert ("param_grad", "embedding.word_embeddings.weight") in diffs


def test_pp2_backward_matches_pp1(dump):
    diffs = assert_agree(dump("backward", "--cp", "1"), dump("backward", "--pp", "2"))
    assert len([1 for kind, _ in diffs if kind == "param_grad"]) == TINY_PARAMETERS
    assert ("activation", "decoder.layers.1") in diffs  # layer 1 lives on stage 1, named globally


def test_padding_masks_the_loss(dump):
    inputs = tensors(dump("backward", "--cp", "1"))
    # built-in sequences of 32 and 20 tokens, padded to 32: labels exist for 31 + 19 positions
    assert inputs["input", "loss_mask"].sum().item() == 31 + 19
    assert inputs["input", "tokens"].shape == (2, 32)


@pytest.mark.parametrize("args", [("--filter", r"layers\.1\."), ("--stats-only",)])
def test_dump_options_keep_inputs(dump, args):
    path = dump("forward", *args)
    from megalign.dump.reader import DumpFiles

    records = [record for _, record in DumpFiles.open(path).records()]
    assert any(r.kind == "input" for r in records)
    if args[0] == "--filter":
        assert all("layers.1." in r.name for r in records if r.kind != "input")
        assert any(r.kind == "activation" for r in records)
    else:
        assert all(r.stats is not None and r.file is None for r in records)


def test_pp2_with_other_weights_is_caught(dump):
    """The failing twin of the PP check: stage 1's layer with different weights does not pass."""
    diffs = max_abs_diffs(dump("backward", "--cp", "1"), dump("backward", "--pp", "2", "--seed", "7"))
    assert diffs["activation", "decoder.layers.1"] > 100 * TOLERANCE
    assert diffs["param_grad", "decoder.layers.1.mlp.linear_fc2.weight"] > 100 * TOLERANCE
