"""A verdict is wrong in two ways; these are the false passes: NaN/Inf that do not line up,
replicas that disagree, comparisons that compared nothing, thresholds that make no sense, tensors
missing on one side, a threshold taken from one tensor's dtype, squares that underflow, a reference
of another run. Each has its agreeing twin."""

from __future__ import annotations

import json
import math

import pytest
import torch
from compare_fixtures import CP1, CP2, TP2, copy_dump
from conftest import invoke
from safetensors.torch import load_file, save_file

import megalign
from megalign.dump.tensorfile import content_hash


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
MOE = ("backward", "--config", "configs/tiny-moe.yaml")  # test_moe.py's session dump


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


def rewrite(dump_dir, rank: int, kind: str, name: str, change, dtype=None, rehash: bool = True) -> None:
    """Replace one rank's stored tensor by `change(tensor)` (stored as `dtype`, if given), and its recorded
    content hash as a run that wrote those values would (unless `rehash` is false)."""
    manifest_path = dump_dir / f"rank-{rank:05d}" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    record = next(r for r in manifest["tensors"] if (r["kind"], r["name"]) == (kind, name))
    file = dump_dir / f"rank-{rank:05d}" / record["file"]
    tensors = load_file(str(file))
    tensors[record["key"]] = change(tensors[record["key"]].clone()).to(dtype or tensors[record["key"]].dtype)
    save_file(tensors, str(file))
    if dtype is not None:
        record["dtype"] = str(dtype).removeprefix("torch.")
    if rehash:
        record["hash"] = content_hash(tensors[record["key"]])
    manifest_path.write_text(json.dumps(manifest))


def with_nan(x):
    x.view(-1)[7] = math.nan
    return x


def test_a_nan_in_one_cp_replica_of_a_parameter_gradient_fails(dump, tmp_path):
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    bad = copy_dump(dump(*CP2), tmp_path / "bad")
    # The file alone changed: its recorded hash still equals rank 0's, so the replica is not read.
    rewrite(bad, 1, "param_grad", name, with_nan, rehash=False)
    result, rows = rows_of(tmp_path, dump(*CP1), bad)
    assert result.exit_code == 0, result.output
    # As a run whose replicas really differed writes it: the hashes differ, the replica is read.
    rewrite(bad, 1, "param_grad", name, lambda x: x)
    result, rows = rows_of(tmp_path, dump(*CP1), bad)
    assert result.exit_code == 1, result.output
    row = next(r for r in rows if (r["kind"], r["name"]) == ("param_grad", name))
    assert row["status"] == "fail" and "B: replicas disagree on where NaN/Inf are (rank 1 vs rank 0)" in row["notes"]
    assert f"first divergence: param_grad {name}" in result.output


REPLICAS = {"cp": (CP2, "decoder.layers.0.mlp.linear_fc2.weight"),  # CP ranks hold the whole gradient each
            "tp": (TP2, "decoder.layers.1.input_layernorm.weight")}  # TP ranks hold the norm's whole gradient


@pytest.mark.parametrize("change", [lambda x: 2 * x, lambda x: -x], ids=["doubled", "sign-flipped"])
@pytest.mark.parametrize("axis", REPLICAS)
def test_replicas_that_disagree_in_value_fail_naming_the_ranks(dump, tmp_path, axis, change):
    layout, name = REPLICAS[axis]
    bad = copy_dump(dump(*layout), tmp_path / "bad")
    rewrite(bad, 1, "param_grad", name, change)
    result, rows = rows_of(tmp_path, dump(*CP1), bad)
    assert result.exit_code == 1, result.output
    row = next(r for r in rows if (r["kind"], r["name"]) == ("param_grad", name))
    assert row["status"] == "fail" and row["replica_diff_b"] > row["threshold"]
    assert any(n.startswith("B: replicas disagree (rank 1 vs rank 0): rel diff") for n in row["notes"]), row["notes"]


def test_replicas_that_differ_by_rounding_pass_and_say_so(dump, tmp_path):
    """The twin: a replica one float32 rounding off (another reduction order would do it) agrees."""
    layout, name = REPLICAS["cp"]
    near = copy_dump(dump(*layout), tmp_path / "near")
    rewrite(near, 1, "param_grad", name, lambda x: x * (1 + 2 ** -23))
    result, rows = rows_of(tmp_path, dump(*CP1), near)
    assert result.exit_code == 0, result.output
    row = next(r for r in rows if (r["kind"], r["name"]) == ("param_grad", name))
    assert 0 < row["replica_diff_b"] <= row["threshold"] and row["status"] == "pass"
    assert any(n.startswith("B: replicas differ within the threshold (rank 1 vs rank 0)") for n in row["notes"])


def drop(dump_dir, gone) -> None:
    """Delete the records `gone(record)` names from every rank's manifest, as a run that never dumped them."""
    for manifest_path in dump_dir.glob("rank-*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        manifest["tensors"] = [r for r in manifest["tensors"] if not gone(r)]
        manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("gone, missing", [
    (lambda r: (r["kind"], r["name"]) == ("activation", "decoder.layers.1.mlp"), 1),  # one record
    (lambda r: r["kind"] == "param_grad", 15),  # every parameter gradient
    # Everything but the inputs: 74 records. The op map excuses none of them: both sides are megatron
    # runs, which dump `decoder`, the RoPE table and the embedding's lookup alike (it once excused 7).
    (lambda r: r["kind"] != "input", 74),
], ids=["one-record", "param-grads", "all-but-inputs"])
def test_tensors_missing_on_one_side_fail(dump, tmp_path, gone, missing):
    bad = copy_dump(dump(*CP2), tmp_path / "bad")
    drop(bad, gone)
    report = tmp_path / "r.jsonl"
    result = invoke("compare", dump(*CP1), bad, "--json", report)
    assert result.exit_code == 1, result.output
    summary = json.loads(report.read_text().splitlines()[-1])
    assert (summary["missing_a"], summary["missing_b"], summary["ok"]) == (missing, 0, False)
    assert f"{missing} missing (only in A {missing}, only in B 0)" in result.output
    assert "all compared tensors within threshold" not in result.output


@pytest.mark.parametrize("gone", [
    lambda r: r["kind"] == "activation_grad",  # what transformers' stack does not dump
    lambda r: r["name"] in ("decoder", "embedding.word_embeddings", "rotary_pos_emb"),  # what HF has no module for
], ids=["activation-grads", "megatron-only-modules"])
def test_the_op_map_excuses_nothing_between_dumps_of_one_stack_and_kernel(dump, tmp_path, gone):
    """The op map names what another stack or attention kernel does not dump: between two megatron runs
    with the same kernel (CP=1 both) the same tensors are missing only because a run lost them."""
    bad = copy_dump(dump(*CP1), tmp_path / "bad")
    drop(bad, gone)
    result = invoke("compare", dump(*CP1), bad)
    assert result.exit_code == 1, result.output
    assert "by the cross-stack op map" not in result.output


def test_a_forward_dump_against_a_backward_dump_fails_unless_allowed(dump, tmp_path):
    """What the op map expects on one side (CP=1's attention internals) is allowed and counted; the
    gradients only the backward has fail, unless --allow-missing names them."""
    result = invoke("compare", dump("forward"), dump(*CP2))
    assert result.exit_code == 1, result.output
    assert "missing (only in A 0, only in B " in result.output
    report = tmp_path / "r.jsonl"
    allowed = invoke("compare", dump("forward"), dump(*CP2), "--allow-missing", "^", "--json", report)
    assert allowed.exit_code == 0, allowed.output
    summary = json.loads(report.read_text().splitlines()[-1])
    assert summary["ok"] and summary["missing_a"] == summary["missing_b"] == 0 and summary["allowed_by_pattern"] >= 40
    assert summary["allowed_by_pattern"] + summary["allowed_by_op_map"] == summary["only_a"] + summary["only_b"]
    assert f"by --allow-missing '^'" in allowed.output


def test_a_tensor_missing_from_a_plain_file_fails_unless_allowed(tmp_path):
    a, b = plain(tmp_path, "a", x=BASE, y=BASE.clone()), plain(tmp_path, "b", x=BASE)
    assert invoke("compare", a, b).exit_code == 1
    allowed = invoke("compare", a, b, "--allow-missing", "^y$")
    assert allowed.exit_code == 0, allowed.output
    assert "1 only in one side allowed: 1 by --allow-missing '^y$'" in allowed.output


@pytest.mark.parametrize("kind, name, dtype, factor", [
    ("param_grad", "decoder.layers.0.mlp.linear_fc1.weight", torch.bfloat16, 1.5),  # 50% off
    ("activation", "decoder.layers.0.mlp", torch.float16, 1.1),  # 10% off
], ids=["bf16-gradient", "f16-activation"])
def test_a_tensor_stored_narrower_is_judged_at_its_run_s_precision(dump, tmp_path, kind, name, dtype, factor):
    bad = copy_dump(dump(*CP1), tmp_path / "bad")
    rewrite(bad, 0, kind, name, lambda x: x * factor, dtype=dtype)
    result, rows = rows_of(tmp_path, dump(*CP1), bad)
    assert result.exit_code == 1, result.output
    row = next(r for r in rows if (r["kind"], r["name"]) == (kind, name))
    assert row["status"] == "fail" and row["threshold"] <= 1e-5
    assert f"B: stored as {str(dtype).removeprefix('torch.')} by a fp32 run; judged at the run's precision" in row["notes"]


def test_a_gradient_stored_as_bf16_with_its_rounding_only_passes(dump, tmp_path):
    """The twin: bf16's own rounding of a gradient is within fp32's gradient threshold."""
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    rounded = copy_dump(dump(*CP1), tmp_path / "rounded")
    rewrite(rounded, 0, "param_grad", name, lambda x: x, dtype=torch.bfloat16)
    result, rows = rows_of(tmp_path, dump(*CP1), rounded)
    assert result.exit_code == 0, result.output
    row = next(r for r in rows if (r["kind"], r["name"]) == ("param_grad", name))
    assert 0 < row["metrics"]["rel_diff"] <= row["threshold"] == 1e-5


@pytest.mark.parametrize("a, b, code", [
    (1e-170, -1e-170, 1),  # a sign flip where the squares underflow to 0
    (0.0, 1e-200, 1),
    (1e-170, 1e-170, 0),  # the twins: equal values agree at any magnitude, huge ones too (squares overflow)
    (1e200, 1e200, 0),
    (1e-320, -1e-320, 1),  # subnormal: scaled by 2^-exp in one step, 2^1073 overflowed and the sums were NaN
    (1e-320, 1e-320, 0),
])
def test_the_relative_difference_holds_at_any_magnitude(tmp_path, a, b, code):
    x = torch.tensor([a, a / 3], dtype=torch.float64)
    y = torch.tensor([b, b / 3], dtype=torch.float64)
    result, rows = rows_of(tmp_path, plain(tmp_path, "a", x=x), plain(tmp_path, "b", x=y))
    assert result.exit_code == code, result.output
    assert rows[0]["metrics"]["rel_diff"] == (0.0 if code == 0 else pytest.approx(2.0 if a else 1.0))


def test_nan_on_both_sides_is_a_warning_and_fails_when_strict(tmp_path):
    x = with_values(i2=math.nan)
    a, b = plain(tmp_path, "a", loss=x), plain(tmp_path, "b", loss=x.clone())
    lenient = invoke("compare", a, b)
    assert lenient.exit_code == 0, lenient.output
    assert "NaN/Inf in both: tensor loss (not failed)" in lenient.output
    strict = invoke("compare", a, b, "--strict-nonfinite")
    assert strict.exit_code == 1, strict.output
    assert "NaN/Inf in both: tensor loss (failed (--strict-nonfinite))" in strict.output
    finite = invoke("compare", plain(tmp_path, "c", loss=BASE), plain(tmp_path, "d", loss=BASE), "--strict-nonfinite")
    assert finite.exit_code == 0 and "NaN/Inf in both" not in finite.output


def test_stats_only_infinities_of_other_signs_are_said_to_be_unchecked_and_fail_when_strict(tmp_path):
    """A stats-only dump counts Inf, no sign: +Inf against -Inf passed as 'at the same positions'."""
    for name, value in (("plus", math.inf), ("minus", -math.inf)):
        with megalign.Dumper(tmp_path / name, stats_only=True) as dumper:
            dumper.add("loss", "loss", with_values(i2=value))
    lenient = invoke("compare", tmp_path / "plus", tmp_path / "minus")
    assert lenient.exit_code == 0, lenient.output
    assert "NaN/Inf counted alike (statistics only: their positions and signs are not recorded)" in lenient.output
    assert "NaN/Inf in both: loss loss (not failed)" in lenient.output
    strict = invoke("compare", tmp_path / "plus", tmp_path / "minus", "--strict-nonfinite")
    assert strict.exit_code == 1, strict.output


def test_a_reference_of_another_model_or_seed_is_exit_2(dump):
    other_seed = dump("backward", "--dtype", "fp64", "--seed", "5")
    seed = invoke("compare", dump(*CP1), dump(*CP2), "--reference", other_seed)
    assert seed.exit_code == 2 and "has other weights than" in seed.output and "seed 5 vs seed 1234" in seed.output
    model = invoke("compare", dump(*MOE), dump(*MOE), "--reference", other_seed)
    assert model.exit_code == 2 and "is another model than" in model.output and "num_moe_experts None vs 4" in model.output
    assert len(model.output.strip().splitlines()) == 1


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
