"""The layouts real training uses: sequence parallelism, data parallelism, the distributed optimizer.

Real megatron-core workers on gloo, against the single-rank run: every activation, activation
gradient, parameter gradient, logits, logprobs and loss within the fp32 tolerance. Each has its
failing twin: a planted bug, caught where it is first seen.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import invoke, tensors
from test_run_layouts import TINY_PARAMETERS, TOLERANCE, assert_agree

from megalign.dump.reader import DumpFiles

SINGLE = ("backward",)
LAYOUTS = {
    "tp2-sp": ("--tp", "2", "--sp"),
    "dp2": ("--dp", "2"),
    "dp2-cp2": ("--dp", "2", "--cp", "2"),
    "dp2-distributed-optimizer": ("--dp", "2", "--distributed-optimizer"),
    "tp2-sp-cp2-dp2": ("--tp", "2", "--sp", "--cp", "2", "--dp", "2"),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_training_layout_matches_the_single_rank_run(dump, layout):
    diffs = assert_agree(dump(*SINGLE), dump("backward", *LAYOUTS[layout]))
    assert len([1 for kind, _ in diffs if kind == "param_grad"]) == TINY_PARAMETERS
    assert sum(kind == "activation_grad" for kind, _ in diffs) >= 20
    assert ("loss", "loss") in diffs and ("logprobs", "logprobs") in diffs


def test_sequence_parallel_shards_are_recorded(dump):
    records = [r for _, r in DumpFiles.open(dump("backward", *LAYOUTS["tp2-sp"])).records()]
    split = {r.name for r in records if r.sharding.sp}
    # Norms, row-parallel outputs and the layer outputs carry half the sequence on each TP rank.
    assert {"decoder.layers.0.input_layernorm", "decoder.layers.0.self_attention.linear_proj", "decoder.layers.1",
            "embedding"} <= split
    assert "decoder.layers.0.mlp.linear_fc1" not in split  # column-parallel: full sequence, hidden split


def test_sequence_parallel_pieces_taken_for_replicas_are_caught(dump, tmp_path):
    """The failing twin: a reader that ignores the SP split sees half a sequence and disagreeing 'replicas'."""
    bad = shutil.copytree(dump("backward", *LAYOUTS["tp2-sp"]), tmp_path / "bad")
    for rank in (0, 1):
        manifest = bad / f"rank-0000{rank}" / "manifest.json"
        raw = json.loads(manifest.read_text())
        for record in raw["tensors"]:
            record["sharding"]["sp"] = False
        manifest.write_text(json.dumps(raw))
    result = invoke("compare", dump(*SINGLE), bad)
    assert result.exit_code == 1
    assert "first divergence: activation embedding" in result.output  # the first tensor SP splits


def test_dp_loss_normalised_per_rank_is_caught(dump):
    """The failing twin of DP: each rank divides by its own token count, so gradients are off."""
    reference = tensors(dump(*SINGLE))
    buggy = dump("backward", "--dp", "2", "--loss-norm", "local")
    result = invoke("compare", dump(*SINGLE), buggy)
    assert result.exit_code == 1 and "first divergence: loss loss" in result.output
    grads = [(buggy_grad - reference[key]).abs().max().item()
             for key, buggy_grad in tensors(buggy).items() if key[0] == "param_grad"]
    assert len(grads) == TINY_PARAMETERS and min(grads) > 100 * TOLERANCE


def test_reading_the_distributed_optimizers_local_shard_fails_loudly(tmp_path):
    """The failing twin of the gather: each rank's shard holds only some parameters' gradients."""
    out = tmp_path / "out"
    result = invoke("backward", "--dp", "2", "--distributed-optimizer", "--grad-source", "shard", "--out", out)
    assert result.exit_code == 1
    line = next(line for line in result.output.splitlines() if line.startswith("error:"))
    # Each rank lacks the parameters outside its shard; whichever rank reports first names its own.
    assert re.search(r"rank [01] failed: \d+ of 15 parameters have no gradient \(read from shard\): (embedding|decoder)\.", line)
    assert not out.exists()
