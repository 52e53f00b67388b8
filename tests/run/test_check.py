"""`megalign check`: a baseline and a target run (and an fp64 reference) and their comparison, in one command."""

from __future__ import annotations

import json

import megalign
from conftest import invoke


def test_check_runs_both_and_passes(tmp_path):
    """With --zoom: runs that agree in their statistics are not run again (the twin of the next test)."""
    out = tmp_path / "check"
    result = invoke("check", "--baseline", "--cp 1", "--target", "--cp 2", "--zoom", "--out", out,
                    "--json", tmp_path / "r.jsonl")
    assert result.exit_code == 0, result.output
    assert [p.name for p in out.iterdir()] == ["stats-only"]
    assert {p.name for p in (out / "stats-only").iterdir()} == {"baseline", "target"}
    summary = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])
    assert summary["ok"] and summary["compared"] > 60
    assert "all compared tensors within threshold" in result.output
    assert "the stats-only pass agrees: nothing to zoom into, no second pass" in result.output


def test_check_zooms_into_the_first_divergence_its_statistics_find(tmp_path):
    """The stats-only pass (baseline and target only) finds the CP loss bug at the loss; the second pass
    dumps values for the tensors around it only, in the fp64 reference too, and its comparison names
    it with full metrics, judged against the reference: B off."""
    out = tmp_path / "check"
    result = invoke("check", "--baseline", "--cp 1", "--target", "--cp 2 --loss-norm local", "--zoom", "--reference",
                    "--out", out, "--json", tmp_path / "r.jsonl")
    assert result.exit_code == 1, result.output
    assert "zoomed: tensors decoder.final_layernorm..loss (5 names), full values (256.5 KiB a run); the rest " \
           "stats-only" in result.output  # counted in fp64, the widest run's dtype
    assert ("first divergence, in full values: loss loss: rel diff 0.2, max abs diff 4.85, B off against the "
            "reference (rel to it A 3.47e-16, B 0.2)") in result.output
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    first = next(row for row in rows if row.get("first_divergence"))
    assert (first["kind"], first["name"], first["metrics"]["mode"]) == ("loss", "loss", "values")
    assert first["reference"]["off"] == "B" and first["threshold"] is None
    assert {p.name for p in (out / "stats-only").iterdir()} == {"baseline", "target"}
    for run, alike in (("target", "target"), ("reference", "baseline")):  # the reference: the baseline's layout
        zoomed = megalign.open(out / "zoomed" / run)
        full = {name for kind, name in zoomed.names() if zoomed.shards(kind, name)[0].stats is None}
        assert full == {"decoder.final_layernorm", "decoder", "logits", "logprobs", "loss"}
        assert len(zoomed.names()) == len(megalign.open(out / "stats-only" / alike).names())


def test_check_catches_the_loss_bug_and_names_the_side(tmp_path):
    """The failing twin: the target divides the loss per CP rank. Options check does not know (--seed)
    go to every run."""
    result = invoke("check", "--seed", "5", "--baseline", "--cp 1", "--target", "--cp 2 --loss-norm local",
                    "--reference", "--out", tmp_path / "check")
    assert result.exit_code == 1, result.output
    assert "first divergence: loss loss" in result.output and "B off" in result.output
    seeds = {json.loads((tmp_path / "check" / run / "dump.json").read_text())["seed"] for run in ("baseline", "target")}
    assert seeds == {5}
    assert json.loads((tmp_path / "check" / "reference" / "dump.json").read_text())["dtype"] == "fp64"


def test_a_failing_run_stops_check_with_its_error(tmp_path):
    bad_input = invoke("check", "--baseline", "--tp 3", "--target", "--cp 1", "--out", tmp_path / "a")
    assert bad_input.exit_code == 2
    own, stopped = bad_input.output.index("error: --tp 3 does not divide"), bad_input.output.index(
        "error: the baseline run failed (exit 2)")  # the run's own error line, then check's
    assert own < stopped and "target:" not in bad_input.output
    unsplittable = invoke("check", "--target", '--cp "2', "--out", tmp_path / "b")
    assert unsplittable.exit_code == 2 and "cannot split" in unsplittable.output
    own_option = invoke("check", "--target", "--out x", "--out", tmp_path / "c")
    assert own_option.exit_code == 2 and "--out is check's own option" in own_option.output
    zoom_option = invoke("check", "--zoom", "--target", "--dump-only loss", "--out", tmp_path / "d")
    assert zoom_option.exit_code == 2 and "--dump-only is --zoom's own option" in zoom_option.output


def test_a_bad_zoom_budget_stops_check_before_any_run(tmp_path):
    for args, error in ((("--zoom", "--zoom-budget", "lots"), "error: --zoom-budget: expected a size such as 2GiB"),
                        (("--zoom-budget", "1GiB"), "error: --zoom-budget is --zoom's: add --zoom")):
        result = invoke("check", *args, "--out", tmp_path / "check")
        assert result.exit_code == 2 and error in result.output, result.output
        assert not (tmp_path / "check").exists()


def test_a_run_option_that_does_not_exist_stops_check_before_any_run(tmp_path):
    result = invoke("check", "--target", "--bogus 3", "--out", tmp_path / "check")
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "megalign check --target '--bogus 3': No such option: --bogus" in lines[0], result.output
    assert "Traceback" not in result.output and "baseline:" not in result.output  # no run started
    assert not (tmp_path / "check").exists()
    shared = invoke("check", "--tp", "x", "--out", tmp_path / "check")
    assert shared.exit_code == 2 and "error: megalign check: Invalid value for '--tp'" in shared.output
