"""`megalign compare A [B] --explain NAME` through the real CLI, on the session's real CP=2, CP=1 and
TP=2 dumps: the plan printed rank by rank, nothing compared."""

from __future__ import annotations

import json

from compare_fixtures import CP1, CP2, TP2, copy_dump
from conftest import invoke

from megalign.dump.format import MANIFEST
from megalign.dump.layout import zigzag_positions


def positions(line: str) -> list[int]:
    """The positions of the whole that a printed rank line's runs along dim 0 cover, in local order."""
    covered = []
    for run in line.split(": dim 0 ")[1].split(", "):
        start, stop = run.split(" -> ")[1].strip("[]").split(":")
        covered += range(int(start), int(stop))
    return covered


def test_explain_prints_where_each_ranks_piece_goes_and_compares_nothing(dump):
    result = invoke("compare", dump(*CP2), dump(*CP1), "--explain", "decoder.layers.1")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"A {dump(*CP2)}: megalign dump: megatron backward, tp=1 pp=1 cp=2, fp32"
    assert lines[1:4] == [
        "  activation decoder.layers.1: 32x2x64 from 2 pieces of 16x2x64; CP 2 along dim 0 (zigzag)",
        "    rank 0 (tp 0 cp 0 dp 0 pp 0): dim 0 [0:8] -> [0:8], [8:16] -> [24:32]",
        "    rank 1 (tp 0 cp 1 dp 0 pp 0): dim 0 [0:16] -> [8:24]",
    ]
    # The printed runs are the zigzag each CP rank holds (dump/layout.py), not the pieces end to end.
    assert [positions(line) for line in lines[2:4]] == [zigzag_positions(16, r, 2).tolist() for r in range(2)]
    assert "  activation_grad decoder.layers.1: 32x2x64 from 2 pieces of 16x2x64; CP 2 along dim 0 (zigzag)" in lines
    b = lines.index(f"B {dump(*CP1)}: megalign dump: megatron backward, tp=1 pp=1 cp=1, fp32")
    assert lines[b + 1:b + 3] == ["  activation decoder.layers.1: 32x2x64 from 1 piece of 32x2x64; not split: every "
                                  "rank holds all of it", "    rank 0 (tp 0 cp 0 dp 0 pp 0): all of it, as it is"]
    assert "compared" not in result.output and "passed" not in result.output


def test_explain_of_fused_tp_shards_places_them_part_by_part(dump):
    result = invoke("compare", dump(*TP2), "--explain", "decoder.layers.0.mlp.linear_fc1.weight")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1:] == [
        "  param_grad decoder.layers.0.mlp.linear_fc1.weight: 256x64 from 2 pieces of 128x64; TP 2 along dim 0 "
        "(2 parts, each split)",
        "    rank 0 (tp 0 cp 0 dp 0 pp 0): dim 0 [0:64] -> [0:64], [64:128] -> [128:192]",
        "    rank 1 (tp 1 cp 0 dp 0 pp 0): dim 0 [0:64] -> [64:128], [64:128] -> [192:256]",
    ]


def test_explain_names_replicas_and_a_shard_that_is_missing(dump, tmp_path):
    """Twin: with rank 1's record of the tensor gone, the plan says what is missing instead of a placement."""
    replicated = invoke("compare", dump(*TP2), "--explain", "decoder.layers.1")
    assert replicated.exit_code == 0, replicated.output
    assert "    rank 1 (tp 1 cp 0 dp 0 pp 0): replica of rank 0, same hash: not read" in replicated.output.splitlines()
    broken = copy_dump(dump(*CP2), tmp_path / "broken")
    manifest_path = broken / "rank-00001" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["tensors"] = [r for r in manifest["tensors"] if (r["kind"], r["name"]) != ("activation", "decoder.layers.1")]
    manifest_path.write_text(json.dumps(manifest))
    result = invoke("compare", broken, "--explain", "decoder.layers.1")
    assert result.exit_code == 0, result.output
    assert ("  activation decoder.layers.1: cannot be put back together: it has 1 of the 2 shards its split (2 CP) "
            "makes") in result.output.splitlines()


def test_an_unknown_name_is_one_line_naming_the_nearest_exit_2(dump):
    result = invoke("compare", dump(*CP2), dump(*CP1), "--explain", "decoder.layers.1.mlpp")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --explain: no tensor 'decoder.layers.1.mlpp' in A or B; near names: decoder.layers.1.mlp, "
        "decoder.layers.0.mlp, decoder.layers.1"]


def test_without_explain_compare_needs_two_inputs(dump):
    result = invoke("compare", dump(*CP2))
    assert result.exit_code == 2
    assert "compare needs two inputs" in result.output and "Traceback" not in result.output
