"""sglang-format dumps written by sglang's own dumper, compared with megalign dumps and each other."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from compare_fixtures import CP1, CP2, CP2_LOCAL, TP2, sglang_dump  # noqa: F401  (a fixture)
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


def param_grads(rows) -> dict[str, str]:
    return {r["name"]: r["status"] for r in rows if r["kind"] == "param_grad"}


def test_two_rank_sglang_dump_is_reassembled_from_dims(dump, sglang_dump, tmp_path):
    """dump_model writes parameter gradients without dims: whole on every CP rank, checked as replicas;
    the loss, the same on both ranks, is the loss reduced over them."""
    result, rows, s = summary(tmp_path, dump(*CP1), sglang_dump(dump(*CP2)))
    assert result.exit_code == 0, result.output
    assert any(r["kind"] == "activation_grad" and r["status"] == "pass" for r in rows)
    grads = param_grads(rows)
    assert len(grads) == 15 and set(grads.values()) == {"pass"}, grads
    assert [r["status"] for r in rows if r["kind"] == "loss"] == ["pass"]
    assert s["not_reassemblable"] == s["skipped"] == s["unverifiable"] == 0 and s["ok"]


# The fused gate|up outputs of linear_fc1 have no sglang spelling under TP: the writer gives them no dims.
FUSED = r"linear_fc1$"


def test_tp2_sglang_dump_splits_parameter_gradients_by_megatron_names(dump, sglang_dump, tmp_path):
    """Column-parallel gradients are put together along dim 0 (linear_fc1's gate|up part by part),
    row-parallel ones along dim 1, norms checked as replicas."""
    result, rows, s = summary(tmp_path, dump(*CP1), sglang_dump(dump(*TP2)), "--allow-skipped", FUSED)
    assert result.exit_code == 0, result.output
    grads = param_grads(rows)
    assert len(grads) == 15 and set(grads.values()) == {"pass"}, grads
    assert {r["name"] for r in rows if r["status"] == "skipped"} == {"decoder.layers.0.mlp.linear_fc1",
                                                                    "decoder.layers.1.mlp.linear_fc1"}


def test_unreassemblable_tensors_fail_unless_allowed(dump, sglang_dump, tmp_path):
    """A tensor that was never compared is not a pass: without --allow-skipped the run fails."""
    result, rows, s = summary(tmp_path, dump(*CP1), sglang_dump(dump(*TP2)))
    assert result.exit_code == 1, result.output
    unplaced = {r["kind"] for r in rows if r["status"] == "not_reassemblable"}
    assert unplaced == {"activation", "activation_grad"} and s["not_reassemblable"] == 4 and not s["ok"]
    # --allow-skipped that covers only some of them still fails on the rest.
    partly = invoke("compare", dump(*CP1), sglang_dump(dump(*TP2)), "--allow-skipped", "layers.0", *NO_LABELS)
    assert partly.exit_code == 1 and "first divergence: activation decoder.layers.1.mlp.linear_fc1" in partly.output


def split_loss(folder, target, shares=(0.3, 0.7)):
    """A copy of an sglang dump whose ranks each hold a part of the loss (0.3 and 0.7 of it), as a
    trainer that dumps its rank's own loss before the reduction writes it."""
    copy = shutil.copytree(folder, target)
    files = sorted(copy.glob("*/*___name=loss___*.pt"))
    assert len(files) == 2
    for file, share in zip(files, shares):
        content = torch.load(file, weights_only=True)
        torch.save({**content, "value": content["value"] * share}, file)
    return copy


def test_per_rank_loss_parts_are_unverifiable_not_a_divergence(dump, sglang_dump, tmp_path):
    result, rows, s = summary(tmp_path, dump(*CP1), split_loss(sglang_dump(dump(*CP2)), tmp_path / "split"))
    assert result.exit_code == 0, result.output
    assert [r["status"] for r in rows if r["kind"] == "loss"] == ["unverifiable"] and s["unverifiable"] == 1
    assert s["first_divergence"] is None and s["ok"]
    assert "1 unverifiable (loss loss: what the values stand for is not recorded; no divergence)" in result.output
    assert "differs between its 2 ranks" in result.output
    # The twin: the loss-norm bug, its loss unverifiable the same way, still fails at the first gradient.
    twin, rows, s = summary(tmp_path, dump(*CP1), split_loss(sglang_dump(dump(*CP2_LOCAL)), tmp_path / "twin"))
    assert twin.exit_code == 1 and s["unverifiable"] == 1
    assert s["first_divergence"] == "activation_grad logits", s["first_divergence"]


@pytest.mark.parametrize("shares", [(30, 70), (1, 5), (0.2, 0.5)])
def test_per_rank_losses_no_reduction_can_give_fail(dump, sglang_dump, tmp_path, shares):
    """The twin of the parts above: per-rank values whose sum is not the loss and that do not hold it
    strictly between them (as a token-weighted mean would) diverged, whatever the convention: rank 0
    at the loss and rank 1 at 5x it, or both 100x, or parts summing to 0.7 of it."""
    split = split_loss(sglang_dump(dump(*CP2)), tmp_path / "bad", shares)
    result, rows, s = summary(tmp_path, dump(*CP1), split)
    assert result.exit_code == 1, result.output
    assert [r["status"] for r in rows if r["kind"] == "loss"] == ["fail"] and s["unverifiable"] == 0
    assert s["first_divergence"] == "loss loss" and "neither sum to the other side's" in result.output


def test_sglang_dump_of_the_loss_bug_fails(dump, sglang_dump, tmp_path):
    result, rows, s = summary(tmp_path, dump(*CP1), sglang_dump(dump(*CP2_LOCAL)))
    assert result.exit_code == 1
    assert s["first_failure_by_kind"].get("activation_grad")
    assert s["first_divergence"] == "loss loss" and set(param_grads(rows).values()) == {"fail"}


def test_sglang_vs_sglang(dump, sglang_dump, tmp_path):
    assert invoke("compare", sglang_dump(dump(*CP1)), sglang_dump(dump(*CP2))).exit_code == 0
    assert invoke("compare", sglang_dump(dump(*CP2)), sglang_dump(dump(*CP2_LOCAL))).exit_code == 1


def earlier_naming(folder, target, with_order=True):
    """A copy of an sglang dump as sglang's earlier dumper wrote it: files named
    `forward_pass_id=F___rank=R___name=X___dump_index=N.pt` (passes counted from 1) holding the bare
    value; its earliest wrote `forward_pass_id=F___name=X.pt` only (with_order=False)."""
    target.mkdir()
    for file in sorted(folder.glob("*/*.pt")):
        tags = dict(part.split("=", 1) for part in file.stem.split("___"))
        kept = {"forward_pass_id": int(tags["step"]) + 1, "rank": tags["rank"], "name": tags["name"],
                "dump_index": tags["dump_index"]}
        if not with_order:
            kept = {key: kept[key] for key in ("forward_pass_id", "name")}
        name = "___".join(f"{key}={value}" for key, value in kept.items()) + ".pt"
        torch.save(torch.load(file, weights_only=True)["value"], target / name)
    return target


def test_the_earlier_dumper_naming_is_read(dump, sglang_dump, tmp_path):
    """Files named with forward_pass_id (the step) and holding the bare tensor give the report of the
    same tensors named as today's dumper names them; a tensor changed in them is the first divergence."""
    today = sglang_dump(dump(*CP1))
    earlier = earlier_naming(today, tmp_path / "earlier")
    result, rows, s = summary(tmp_path, dump(*CP2), earlier)
    assert result.exit_code == 0, result.output
    _, today_rows, _ = summary(tmp_path, dump(*CP2), today)
    assert [(r["kind"], r["name"], r["status"]) for r in rows] == \
        [(r["kind"], r["name"], r["status"]) for r in today_rows]
    assert s["passed"] > 40 and s["missing_a"] == s["missing_b"] == 0, s
    # The twin: one layer's output scaled in the earlier files.
    (file,) = earlier.glob("*___name=decoder.layers.1___*.pt")
    torch.save(torch.load(file, weights_only=True) * 1.01, file)
    twin, _, s = summary(tmp_path, dump(*CP2), earlier)
    assert twin.exit_code == 1 and s["first_divergence"] == "activation decoder.layers.1", s["first_divergence"]


def test_the_earliest_dumper_naming_is_refused_saying_why(dump, sglang_dump, tmp_path):
    earliest = earlier_naming(sglang_dump(dump(*CP1)), tmp_path / "earliest", with_order=False)
    result = invoke("compare", dump(*CP2), earliest)
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if "earliest" in line]
    assert "does not record the order the tensors were dumped in" in line
