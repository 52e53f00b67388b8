"""`megalign compare` on real dumps: each passing comparison has a failing twin with a planted bug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

from compare_fixtures import CP1, CP2, CP2_LOCAL, TP2, copy_dump, perturb
from conftest import invoke

from megalign.dump.sharding import zigzag_positions


def read_jsonl(path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return records[:-1], records[-1]


def test_cp1_vs_cp2_passes(dump, tmp_path):
    report = tmp_path / "r.jsonl"
    result = invoke("compare", dump(*CP1), dump(*CP2), "--json", report)
    assert result.exit_code == 0, result.output
    rows, summary = read_jsonl(report)
    assert summary["ok"] and summary["failed"] == 0 and summary["compared"] > 60
    # megatron's local attention (CP=1) has submodules the CP attention has not: the op map allows them.
    assert summary["only_a"] > 0 and {r["status"] for r in rows if "scale_mask_softmax" in r["name"]} == {"only_a"}
    assert summary["allowed_by_op_map"] == summary["only_a"] and summary["missing_a"] == summary["missing_b"] == 0
    # TP-sharded parameter gradients are compared, never skipped.
    grads = [r for r in rows if r["kind"] == "param_grad"]
    assert grads and all(r["status"] == "pass" for r in grads)
    assert max(r["metrics"]["max_abs_diff"] for r in rows if r["metrics"]) < 1e-5
    assert "all compared tensors within threshold" in result.output


def test_loss_norm_local_fails_on_parameter_gradients(dump, tmp_path):
    report = tmp_path / "r.jsonl"
    result = invoke("compare", dump(*CP1), dump(*CP2_LOCAL), "--json", report)
    assert result.exit_code == 1, result.output
    rows, summary = read_jsonl(report)
    failed_grads = [r for r in rows if r["kind"] == "param_grad" and r["status"] == "fail"]
    assert failed_grads and f"param_grad {failed_grads[0]['name']}" in result.output
    # Gradients are about 2x: rel diff 1 - 4/5 = 0.2; the forward is unaffected.
    assert all(abs(r["metrics"]["rel_diff"] - 0.2) < 0.03 for r in failed_grads)
    assert all(r["status"] in ("pass", "only_a") for r in rows if r["kind"] == "activation")


def test_threshold_and_tolerance_overrides(dump):
    a, b = dump(*CP1), dump(*CP2_LOCAL)
    assert invoke("compare", a, b, "--threshold", "0.3").exit_code == 0
    tight = invoke("compare", a, b, "--threshold", "0.3", "--tolerance", r"linear_fc2\.weight=1e-7")
    assert tight.exit_code == 1, tight.output
    assert "first divergence: param_grad decoder.layers.0.mlp.linear_fc2.weight" in tight.output


def test_filter_restricts_rows(dump, tmp_path):
    report = tmp_path / "r.jsonl"
    result = invoke("compare", dump(*CP1), dump(*CP2_LOCAL), "--filter", r"layers\.1\.mlp\.linear_fc1$", "--json", report)
    rows, _ = read_jsonl(report)
    assert {r["name"] for r in rows} == {"decoder.layers.1.mlp.linear_fc1"}
    assert result.exit_code == 1  # its activation passes, its gradient does not


def test_filter_and_threshold_together(dump, tmp_path):
    """The README's `compare dumps/cp1 dumps/cp2 --filter 'layers\\.1\\.' --threshold 1e-4`: only layer 1's rows,
    each judged at 1e-4; the twin, the loss bug's gradients (rel diff 0.2), fails under the same options."""
    options = ("--filter", r"layers\.1\.", "--threshold", "1e-4")
    report = tmp_path / "r.jsonl"
    result = invoke("compare", dump(*CP1), dump(*CP2), *options, "--json", report)
    assert result.exit_code == 0, result.output
    rows, summary = read_jsonl(report)
    assert summary["compared"] > 10 and all(".layers.1." in r["name"] for r in rows)
    assert {r["threshold"] for r in rows if r["status"] == "pass"} == {1e-4}
    assert invoke("compare", dump(*CP1), dump(*CP2_LOCAL), *options).exit_code == 1


def test_perturbed_layer_is_the_first_divergence(dump, tmp_path):
    twin = copy_dump(dump(*CP2), tmp_path / "twin")
    assert invoke("compare", dump(*CP1), twin).exit_code == 0
    bad = copy_dump(dump(*CP2), tmp_path / "bad")
    perturb(bad, "activation", "decoder.layers.0", rank=1, scale=1e-2, at=0)
    report = tmp_path / "r.jsonl"
    result = invoke("compare", dump(*CP1), bad, "--json", report)
    assert result.exit_code == 1
    rows, summary = read_jsonl(report)
    assert summary["first_divergence"] == "activation decoder.layers.0"
    first = next(r for r in rows if r["first_divergence"])
    # Local position 0 of CP rank 1 is global position 8 of 32 once the zigzag is undone.
    seq_len = first["shape_a"][0]
    assert first["metrics"]["max_abs_index"][0] == int(zigzag_positions(seq_len // 2, 1, 2)[0]) == 8
    assert abs(first["metrics"]["max_abs_diff"] - 1e-2) < 1e-4
    assert "first divergence: activation decoder.layers.0" in result.output


def test_tp2_vs_tp1_passes_and_perturbed_shard_fails(dump, tmp_path):
    result = invoke("compare", dump(*CP1), dump(*TP2))
    assert result.exit_code == 0, result.output
    bad = copy_dump(dump(*TP2), tmp_path / "bad")
    perturb(bad, "param_grad", "decoder.layers.1.mlp.linear_fc1.weight", rank=1, scale=1.0)
    failing = invoke("compare", dump(*CP1), bad)
    assert failing.exit_code == 1
    assert "first divergence: param_grad decoder.layers.1.mlp.linear_fc1.weight" in failing.output


def test_incomplete_and_foreign_inputs_exit_2(dump, tmp_path):
    no_manifest = copy_dump(dump(*CP2), tmp_path / "no_manifest")
    (no_manifest / "rank-00001" / "manifest.json").unlink()
    no_meta = copy_dump(dump(*CP2), tmp_path / "no_meta")
    (no_meta / "dump.json").unlink()
    truncated = copy_dump(dump(*CP2), tmp_path / "truncated")
    tensor_file = next((truncated / "rank-00000").glob("*.safetensors"))
    tensor_file.write_bytes(tensor_file.read_bytes()[:1000])
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {no_manifest: "incomplete dump", no_meta: "incomplete dump", truncated: "unreadable",
             empty: "not a megalign dump", tmp_path / "missing": "no such file"}
    for path, message in cases.items():
        result = invoke("compare", dump(*CP1), path)
        assert result.exit_code == 2, (path, result.output)
        assert message in result.output and "Traceback" not in result.output
    assert invoke("compare", dump(*CP1), "--tolerance", "[=1", dump(*CP2)).exit_code == 2


def test_json_report_and_plot(dump, tmp_path):
    report, plot = tmp_path / "r.jsonl", tmp_path / "divergence.png"
    result = invoke("compare", dump(*CP1), dump(*CP2_LOCAL), "--json", report, "--plot", plot)
    assert result.exit_code == 1
    rows, summary = read_jsonl(report)
    assert summary["record"] == "summary" and summary["compared"] == summary["passed"] + summary["failed"]
    assert [r["order"] for r in rows] == list(range(len(rows)))
    assert sum(r["first_divergence"] for r in rows) == 1
    logprobs = next(r for r in rows if r["kind"] == "logprobs")
    assert logprobs["logprobs"]["worst_token"] is not None and logprobs["logprobs"]["p99_abs_diff"] >= 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_report_path_linked_to_another_file_gets_a_file_of_its_own(dump, tmp_path):
    """A hard link (the same file under another name) to an earlier report is replaced by a new file, the
    earlier report kept; one to an input's manifest is no report: refused, the manifest untouched."""
    a = copy_dump(dump(*CP1), tmp_path / "a")
    kept = tmp_path / "kept.jsonl"
    assert invoke("compare", a, dump(*CP2), "--json", kept).exit_code == 0
    before = kept.read_bytes()
    os.link(kept, tmp_path / "r.jsonl")
    result = invoke("compare", a, dump(*CP1), "--json", tmp_path / "r.jsonl")
    assert result.exit_code == 0, result.output
    assert kept.read_bytes() == before
    assert read_jsonl(tmp_path / "r.jsonl")[1]["ok"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "kept.jsonl", "r.jsonl"]  # no temporary file left
    manifest = a / "rank-00000" / "manifest.json"
    before = manifest.read_bytes()
    os.link(manifest, tmp_path / "m.jsonl")
    result = invoke("compare", a, dump(*CP1), "--json", tmp_path / "m.jsonl")
    assert result.exit_code == 2 and "is not a megalign report" in result.output
    assert manifest.read_bytes() == before


def test_whether_a_file_is_a_report_is_read_at_its_ends(tmp_path):
    """is_report read a user's file line by line to its end: 256 MiB without a newline (a disk image, a core
    dump) was held in memory whole before it was refused. The first and last lines decide."""
    from megalign.compare.report import is_report

    tensor, summary = (json.dumps({"record": kind, "name": "h"}) + "\n" for kind in ("tensor", "summary"))
    for content, expected in ((tensor * 3 + summary, True), (summary, True), (tensor, False), (summary + tensor, False),
                              (summary * 2, False), ("my notes\n" + summary, False), (tensor + summary[:-3], False)):
        (tmp_path / "r.jsonl").write_text(content)
        assert is_report(tmp_path / "r.jsonl") == expected, content
    big = tmp_path / "big.img"
    big.write_text(tensor)
    os.truncate(big, 256 << 20)  # sparse: 256 MiB of NULs after one record, on no disk
    tracemalloc.start()
    try:
        assert not is_report(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_a_report_path_that_is_not_a_file_is_named(dump):
    result = invoke("compare", dump(*CP1), dump(*CP1), "--json", "/dev/full")
    assert result.exit_code == 2
    assert "--json /dev/full is not a regular file" in result.output and "Traceback" not in result.output


def test_a_reader_that_leaves_early_does_not_change_the_verdict(dump):
    """`megalign compare A B | head -0`: the pipe is closed before the first line is printed."""
    run = subprocess.Popen([sys.executable, "-m", "megalign", "compare", str(dump(*CP1)), str(dump(*CP1))],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run.stdout.close()
    stderr = run.stderr.read()
    assert run.wait(timeout=300) == 0, stderr
    assert stderr == ""


def test_standard_output_that_cannot_be_written_is_one_line(dump):
    """`megalign compare A B > /dev/full`: the report is lost, so the verdict is not given (exit 2)."""
    with open("/dev/full", "w") as full:
        run = subprocess.run([sys.executable, "-m", "megalign", "compare", str(dump(*CP1)), str(dump(*CP1))],
                             stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr == "error: cannot write to standard output: No space left on device\n"


def test_stats_only_dumps_compare_by_summaries(dump):
    stats = dump("backward", "--cp", "2", "--stats-only")
    assert invoke("compare", dump(*CP1), stats).exit_code == 0
    failing = invoke("compare", dump(*CP2_LOCAL), stats)
    assert failing.exit_code == 1 and "stats only" in failing.output


def test_two_dp_ranks_on_one_data_shard_are_named_by_rank(dump, tmp_path, monkeypatch):
    """DP=2 against DP=1 agrees; the twin, DP rank 1 reading rank 0's rows (MEGALIGN_FAULT=same-rows@1),
    fails first at the tokens, and the row and the summary say that rank 1 holds rank 0's rows, at 80
    columns. Leaving the inputs out (--skip-kind), it is first seen at the first activation."""
    assert invoke("compare", dump("backward"), dump("backward", "--dp", "2")).exit_code == 0
    monkeypatch.setenv("MEGALIGN_FAULT", "same-rows@1")
    assert invoke("backward", "--dp", "2", "--out", tmp_path / "same").exit_code == 0
    said = "B's DP rank 1 holds the rows of its DP rank 0 (data sharding?)"
    result = invoke("compare", dump("backward"), tmp_path / "same", "--format", "table", env={"COLUMNS": "80"})
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert f"first divergence: input tokens\n  {said}\n" in result.output
    assert f"  0: {said}" in lines  # the row's note, under the table that leaves no room for it
    assert max(map(len, lines[lines.index(""):lines.index("first divergence: input tokens") + 2])) <= 80
    skipped = invoke("compare", dump("backward"), tmp_path / "same", "--skip-kind", "input", "--filter", "embedding")
    assert skipped.exit_code == 1, skipped.output
    assert f"first divergence: activation embedding.word_embeddings\n  {said}\n" in skipped.output


def test_kinds_are_chosen_by_name_and_an_unknown_one_is_refused(dump):
    a, b = dump(*CP1), dump(*CP2_LOCAL)
    kept = invoke("compare", a, b, "--kind", "loss,param_grad", "--filter", "loss|layers.1")
    assert kept.exit_code == 1 and "7 compared" in kept.output, kept.output
    left = invoke("compare", a, b, "--skip-kind", "loss,param_grad,activation_grad")
    assert left.exit_code == 0, left.output
    unknown = invoke("compare", a, b, "--kind", "param_grads")
    assert unknown.exit_code == 2 and unknown.output == (
        "error: --kind 'param_grads': unknown kind 'param_grads'; kinds: input, activation, activation_grad, "
        "param_grad, logits, logprobs, loss, routing, param\n")
    none = invoke("compare", a, b, "--kind", "routing")
    assert none.exit_code == 2 and "--kind 'routing' matches none of the" in none.output


def test_of_two_bad_inputs_the_first_one_checked_is_named(dump, tmp_path):
    """The one line names the first error in the order compare checks: its options before any input is
    read, a rollout's export before the dumps are opened, then A, B and R in turn."""
    missing = {side: tmp_path / f"missing-{side}" for side in "ABR"}
    cases = [(("--kind", "bogus"), "--kind 'bogus': unknown kind"),
             (("--export-worst", "0", tmp_path / "w.json"), "--export-worst 0: N must be at least 1"),
             (("--export-worst", "1", tmp_path / "w.json"), "neither A nor B is a rollout file"),
             ((), f"{missing['A']}: no such file or folder")]
    for args, words in cases:
        refused = invoke("compare", missing["A"], missing["B"], "--reference", missing["R"], *args)
        assert refused.exit_code == 2 and words in refused.output and len(refused.output.splitlines()) == 1, args
    refused = invoke("compare", dump(*CP1), missing["B"], "--reference", missing["R"])
    assert refused.exit_code == 2 and f"{missing['B']}: no such file" in refused.output
    refused = invoke("compare", dump(*CP1), dump(*CP1), "--reference", missing["R"])
    assert refused.exit_code == 2 and f"{missing['R']}: no such file" in refused.output
