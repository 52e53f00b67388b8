"""sglang-format dumps written by sglang's own dumper, compared with megalign dumps and each other."""

from __future__ import annotations

import json

from compare_fixtures import CP1, CP2, CP2_LOCAL, sglang_dump  # noqa: F401  (a fixture)
from conftest import invoke


# sglang has no name for labels and loss masks: its dumps hold the tokens and positions only (sglang_writer.py).
NO_LABELS = ("--allow-missing", "^(labels|loss_mask)$")


def summary(tmp_path, *args):
    """Run compare with a --json report, allowing NO_LABELS; (result, tensor rows, summary record)."""
    report = tmp_path / "r.jsonl"
    result = invoke("compare", *args, *NO_LABELS, "--json", report)
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    return result, lines[:-1], lines[-1]


def test_single_rank_sglang_dump_matches_megalign_cp2(dump, sglang_dump, tmp_path):
    result, rows, s = summary(tmp_path, dump(*CP2), sglang_dump(dump(*CP1)))
    assert result.exit_code == 0, result.output
    assert "sglang dump" in result.output
    kinds = {r["kind"] for r in rows if r["status"] == "pass"}
    assert {"input", "activation", "activation_grad", "param_grad", "logprobs", "loss"} <= kinds
    assert s["not_reassemblable"] == 0 and s["missing_a"] == s["missing_b"] == 0 and s["allowed_by_pattern"] == 2


# dump_model gives parameter gradients no dims, nor the loss: at CP=2 they cannot be reassembled.
UNPLACED = r"weight$|^loss$"


def test_two_rank_sglang_dump_is_reassembled_from_dims(dump, sglang_dump, tmp_path):
    result, rows, s = summary(tmp_path, dump(*CP1), sglang_dump(dump(*CP2)), "--allow-skipped", UNPLACED)
    assert result.exit_code == 0, result.output
    assert any(r["kind"] == "activation_grad" and r["status"] == "pass" for r in rows)
    skipped = {r["kind"] for r in rows if r["status"] == "skipped"}
    assert skipped == {"param_grad", "loss"} and s["skipped"] > 10 and s["not_reassemblable"] == 0
    assert "skipped (not reassemblable, allowed by --allow-skipped" in result.output


def test_unreassemblable_tensors_fail_unless_allowed(dump, sglang_dump, tmp_path):
    """A tensor that was never compared is not a pass: without --allow-skipped the run fails."""
    result, rows, s = summary(tmp_path, dump(*CP1), sglang_dump(dump(*CP2)))
    assert result.exit_code == 1, result.output
    unplaced = {r["kind"] for r in rows if r["status"] == "not_reassemblable"}
    assert unplaced == {"param_grad", "loss"} and s["not_reassemblable"] > 10 and not s["ok"]
    # --allow-skipped that covers only some of them still fails on the rest.
    partly = invoke("compare", dump(*CP1), sglang_dump(dump(*CP2)), "--allow-skipped", "^loss$", *NO_LABELS)
    assert partly.exit_code == 1 and "first divergence: param_grad" in partly.output


def test_sglang_dump_of_the_loss_bug_fails(dump, sglang_dump, tmp_path):
    result, rows, s = summary(tmp_path, dump(*CP1), sglang_dump(dump(*CP2_LOCAL)))
    assert result.exit_code == 1
    assert s["first_failure_by_kind"].get("activation_grad")


def test_sglang_vs_sglang(dump, sglang_dump, tmp_path):
    assert invoke("compare", sglang_dump(dump(*CP1)), sglang_dump(dump(*CP2)), "--allow-skipped", UNPLACED).exit_code == 0
    assert invoke("compare", sglang_dump(dump(*CP2)), sglang_dump(dump(*CP2_LOCAL)),
                  "--allow-skipped", UNPLACED).exit_code == 1
