"""A verdict is wrong in two ways; these are the false passes: NaN/Inf that do not line up,
replicas that disagree, comparisons that compared nothing, thresholds that make no sense."""

from __future__ import annotations

import json
import math

import pytest
import torch
from compare_fixtures import CP1, CP2, TP2, copy_dump
from conftest import invoke
from safetensors.torch import load_file, save_file

from megalign.alignment.dump.tensorfile import content_hash


def plain(tmp_path, name: str, **tensors) -> str:
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def rows_of(tmp_path, *args):
    report = tmp_path / "r.jsonl"
    result = invoke("compare", *args, "--json", report)
    lines = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return result, lines[:-1]


BASE = torch.arange(8, dtype=torch.float32)


def with_values(**at) -> torch.Tensor:
    x = BASE.clone()
    for index, value in at.items():
        x[int(index.removeprefix("i"))] = value
    return x


@pytest.mark.parametrize("a, b", [
    (with_values(i3=math.inf), with_values(i3=-math.inf)),  # opposite infinities at one index
    (with_values(i2=math.nan), with_values(i5=math.nan)),  # one NaN each, at different positions
    (with_values(i2=math.nan), BASE),  # NaN where the other side has a number
    (with_values(i2=math.inf), with_values(i2=math.nan)),
])
def test_nonfinite_values_that_do_not_line_up_fail(tmp_path, a, b):
    result, rows = rows_of(tmp_path, plain(tmp_path, "a", x=a), plain(tmp_path, "b", x=b))
    assert result.exit_code == 1, result.output
    assert rows[0]["status"] == "fail" and "different positions or signs" in rows[0]["notes"][0]


def test_nonfinite_values_that_line_up_pass_and_say_so(tmp_path):
    """The rounding twin: NaN and Inf at the same places, the rest equal, is agreement."""
    x = with_values(i2=math.nan, i4=-math.inf)
    result, rows = rows_of(tmp_path, plain(tmp_path, "a", x=x), plain(tmp_path, "b", x=x.clone()))
    assert result.exit_code == 0, result.output
    assert rows[0]["status"] == "pass" and "same positions on both sides" in rows[0]["notes"][0]
    all_nan = torch.full((4,), math.nan)
    result, rows = rows_of(tmp_path, plain(tmp_path, "c", y=all_nan), plain(tmp_path, "d", y=all_nan.clone()))
    assert result.exit_code == 0 and "A 4 NaN" in rows[0]["notes"][0]


def test_a_nan_in_one_cp_replica_of_a_parameter_gradient_fails(dump, tmp_path):
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    bad = copy_dump(dump(*CP2), tmp_path / "bad")
    manifest = json.loads((bad / "rank-00001" / "manifest.json").read_text())
    record = next(r for r in manifest["tensors"] if (r["kind"], r["name"]) == ("param_grad", name))
    file = bad / "rank-00001" / record["file"]
    tensors = load_file(str(file))
    tensors[record["key"]].view(-1)[7] = math.nan
    save_file(tensors, str(file))
    # The file alone changed: its recorded hash still equals rank 0's, so the replica is not read.
    result, rows = rows_of(tmp_path, dump(*CP1), bad)
    assert result.exit_code == 0, result.output
    # As a run whose replicas really differed writes it: the hashes differ, the replica is read.
    record["hash"] = content_hash(tensors[record["key"]])
    (bad / "rank-00001" / "manifest.json").write_text(json.dumps(manifest))
    result, rows = rows_of(tmp_path, dump(*CP1), bad)
    assert result.exit_code == 1, result.output
    row = next(r for r in rows if (r["kind"], r["name"]) == ("param_grad", name))
    assert row["status"] == "fail" and "B: replicas disagree on where NaN/Inf are" in row["notes"]
    assert f"first divergence: param_grad {name}" in result.output


def test_a_filter_that_matches_nothing_is_exit_2(dump):
    result = invoke("compare", dump(*CP1), dump(*CP2), "--filter", "zzz")
    assert result.exit_code == 2 and "matches none of the" in result.output


def test_two_unrelated_inputs_are_exit_2(dump, tmp_path):
    result = invoke("compare", dump(*CP1), plain(tmp_path, "other", unrelated=BASE))
    assert result.exit_code == 2 and "share no tensor" in result.output


def test_tensors_that_cannot_be_reassembled_fail_unless_allowed(dump, tmp_path):
    """One TP shard of a TP-split gradient goes missing: never compared, so not a pass."""
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    bad = copy_dump(dump(*TP2), tmp_path / "bad")
    manifest_path = bad / "rank-00001" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tensors"] = [r for r in manifest["tensors"] if (r["kind"], r["name"]) != ("param_grad", name)]
    manifest_path.write_text(json.dumps(manifest))
    result = invoke("compare", dump(*CP1), bad)
    assert result.exit_code == 1 and f"first divergence: param_grad {name}" in result.output
    allowed = invoke("compare", dump(*CP1), bad, "--allow-skipped", r"fc1\.weight$")
    assert allowed.exit_code == 0, allowed.output
    assert "1 skipped (not reassemblable, allowed by --allow-skipped" in allowed.output
    nothing = invoke("compare", dump(*CP1), bad, "--filter", f"^{name}$", "--allow-skipped", ".")
    assert nothing.exit_code == 2 and "nothing compared" in nothing.output


@pytest.mark.parametrize("args", [("--threshold", "nan"), ("--threshold", "-1"), ("--threshold", "inf"),
                                  ("--tolerance", "logits=nan"), ("--tolerance", "logits=-inf")])
def test_thresholds_must_be_finite_and_not_negative(dump, args):
    result = invoke("compare", dump(*CP1), dump(*CP1), *args)
    assert result.exit_code == 2 and "a threshold must be a finite number >= 0" in result.output
