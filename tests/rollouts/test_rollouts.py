"""Engine rollouts against the trainer, on the real SmolLM2 checkpoint (tests/real_checkpoint.py).

transformers' `generate` with its KV cache is the live engine (rollout_engine.py): one generation of
2 prompts and 16 new tokens, written in every format megalign reads. Each file's tokens and loss mask
are what `megalign forward --rollout FILE --cp 2` runs (the same run for every file: the test checks
that each file plans it), and `megalign compare FILE DUMP` passes at the default fp32 thresholds:
generate's cached decode differs from the trainer's full forward by at most ~3e-5 in a logprob (rel
diff ~3e-11, against 1e-8). Each twin fails and is named as its cause.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
from conftest import error_line, invoke
from real_checkpoint import build
from rollout_engine import TEMPERATURE, UFFFD_AT, generate, jsonl, write_all

from megalign.cli.run import parse_run
from megalign.rollouts.formats import FORMATS as ROLLOUT_FORMATS
from megalign.rollouts.read import read_rollout
from megalign.run.plan import plan_run

FORMATS = ("sglang.json", "vllm.json", "completions-echo.json", "completions-ids.json", "chat.jsonl",
           "rollout.jsonl", "slime.jsonl")
DUMPED = ("--filter", "^logits$|^logprobs$")  # the inputs are always dumped


@pytest.fixture(scope="session")
def rollouts(tmp_path_factory):
    checkpoint = build()
    samples, tokenizer = generate(checkpoint)
    return checkpoint, write_all(tmp_path_factory.mktemp("rollouts"), samples, tokenizer)


@pytest.fixture(scope="session")
def trainer(rollouts, dump):
    """`trainer(*layout)`: the forward dump of the JSONL rollout's tokens under that layout, once."""
    checkpoint, files = rollouts
    return lambda *layout: dump("forward", "--hf", checkpoint, "--rollout", files["rollout.jsonl"], *layout, *DUMPED)


@pytest.fixture(scope="session")
def reference(rollouts, dump):
    """The fp64 run of the rollout's tokens (transformers, in process)."""
    checkpoint, files = rollouts
    return dump("forward", "--stack", "hf", "--dtype", "fp64", "--hf", checkpoint, "--rollout",
                files["rollout.jsonl"], *DUMPED)


def compare(tmp_path, a, b, *args):
    report = tmp_path / "r.jsonl"
    result = invoke("compare", a, b, "--json", report, "--format", "plain", *args)
    lines = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return result, {row["name"]: row for row in lines[:-1]}


def rollout_tokens(path):
    return read_rollout(path).tokens()


def planned(checkpoint, path, tmp_path):
    config = parse_run("forward", ["--hf", str(checkpoint), "--rollout", str(path), "--cp", "2",
                                   "--out", str(tmp_path / "unused")])
    return plan_run(config)


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_agrees_with_the_trainer_at_cp2(rollouts, trainer, tmp_path, name):
    checkpoint, files = rollouts
    spec, reference = planned(checkpoint, files[name], tmp_path), planned(checkpoint, files["rollout.jsonl"], tmp_path)
    assert replace(spec, out="") == replace(reference, out="")  # the same tokens and loss mask: the same run
    assert spec.seq_len % 4 == 0 and sum(map(sum, spec.label_mask)) == 32  # the 2 x 16 response tokens
    result, rows = compare(tmp_path, files[name], trainer("--cp", "2"))
    assert result.exit_code == 0, result.output
    assert rows["tokens"]["status"] == rows["loss_mask"]["status"] == rows["logprobs"]["status"] == "pass"
    assert rows["logprobs"]["logprobs"]["tokens"] == 32 and rows["logprobs"]["logprobs"]["max_abs_diff"] < 1e-4
    assert "worst sequences by k3 KL" in result.output and "cause:" not in result.output


def test_packed_trainer_agrees_dump_first(rollouts, trainer, tmp_path):
    """RL trainers pack: the packed CP=2 run's logprobs line up with the rollout, either argument order."""
    _, files = rollouts
    result, rows = compare(tmp_path, trainer("--cp", "2", "--packed", "--attention", "torch"), files["sglang.json"])
    assert result.exit_code == 0, result.output
    assert rows["logprobs"]["status"] == "pass"


def test_temperature_twin_is_named_with_its_t(rollouts, trainer, tmp_path):
    _, files = rollouts
    result, rows = compare(tmp_path, files["twin-temperature.json"], trainer("--cp", "2"))
    assert result.exit_code == 1, result.output
    assert rows["logprobs"]["status"] == "fail"
    cause = next(line for line in result.output.splitlines() if line.startswith("cause:"))
    assert "temperature" in cause, result.output
    estimated = float(cause.split("T ≈ ")[1].split()[0])
    assert abs(estimated - TEMPERATURE) < 1e-3


def test_shift_twin_is_named(rollouts, trainer, tmp_path):
    _, files = rollouts
    result, _ = compare(tmp_path, files["twin-shift.jsonl"], trainer("--cp", "2"))
    assert result.exit_code == 1, result.output
    assert "cause: logprobs shifted by one position" in result.output
    assert "temperature" not in result.output


@pytest.fixture(scope="session")
def own_trainer(rollouts, dump):
    """`own_trainer(name, *filter)`: the fp32 transformers run of that twin's own tokens, once."""
    checkpoint, files = rollouts
    return lambda name, *dumped: dump("forward", "--stack", "hf", "--hf", checkpoint, "--rollout", files[name],
                                      *(dumped or DUMPED))


def causes_said(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("cause:")]


@pytest.mark.parametrize("dumped", (DUMPED, ("--filter", "^logprobs$")))
def test_ids_of_another_tokenizer_are_a_wrong_model_not_sampling(rollouts, own_trainer, tmp_path, dumped):
    """The engine's raw logprobs on ids shifted by one in the vocabulary (another tokenizer's numbering), against the
    trainer run on those ids: the sampled tokens are improbable to the trainer (around 1e-7), which no sampling
    setting explains. Without the logits in the dump it was "top-p/top-k renormalisation or a temperature below 1";
    with them, none."""
    _, files = rollouts
    result, rows = compare(tmp_path, files["twin-wrong-ids.jsonl"], own_trainer("twin-wrong-ids.jsonl", *dumped))
    assert result.exit_code == 1 and rows["logprobs"]["status"] == "fail", result.output
    said = causes_said(result)
    assert len(said) == 1 and said[0].startswith("cause: wrong model, tokenizer or ids: "), result.output
    assert "of the 32 sampled tokens are improbable to the trainer" in said[0]
    assert "renormalisation" not in result.output and "temperature" not in result.output


def test_a_few_ids_read_from_replacement_bytes_leave_the_temperature_named(rollouts, own_trainer, tmp_path):
    """SGLang's output logprobs at T = 0.7 with two of the 32 ids the "\ufffd" token's (as vLLM's bytes for a piece
    of a UTF-8 character read back): the tokens before them are still a temperature of 0.7, and they are named by
    their place. Their gap hid the temperature: no cause was named."""
    _, files = rollouts
    name = "twin-temperature-ufffd.json"
    result, rows = compare(tmp_path, files[name], own_trainer(name))
    assert result.exit_code == 1 and rows["logprobs"]["status"] == "fail", result.output
    said = causes_said(result)
    assert len(said) == 2 and said[0].startswith("cause: temperature-scaled rollout"), result.output
    assert abs(float(said[0].split("T ≈ ")[1].split()[0]) - TEMPERATURE) < 1e-3
    # The third: the token after the wrong id in sequence 0, improbable to the trainer in the wrong id's context.
    assert said[1].startswith("cause: 3 of the 32 sampled tokens are improbable to the trainer"), said[1]
    content = json.loads(files[name].read_text())
    for sample, k in UFFFD_AT:  # response token k sits at position prompt + k, predicted at the position before
        position = content[sample]["meta_info"]["prompt_tokens"] + k - 1
        assert f"seq {sample} pos {position} token 24211:" in said[1], said[1]


def test_a_rollout_without_hf_is_told_to_pass_it(rollouts, tmp_path):
    """A real model's ids against the default tiny model (a vocabulary of 128): the refusal says to pass --hf."""
    _, files = rollouts
    result = invoke("forward", "--rollout", files["rollout.jsonl"], "--out", tmp_path / "o")
    assert result.exit_code == 2, result.output
    line = error_line(result)
    assert "outside the vocabulary [0, 128)" in line and "pass --hf CHECKPOINT, the checkpoint the engine ran" in line


def test_reference_finds_no_side_off(rollouts, trainer, reference, tmp_path):
    _, files = rollouts
    result, rows = compare(tmp_path, files["vllm.json"], trainer("--cp", "2"), "--reference", reference)
    assert result.exit_code == 0, result.output
    assert rows["logprobs"]["reference"]["off"] is None
    assert "per token against the reference" in result.output


def test_engine_with_one_norm_epsilon_changed_is_the_side_off(rollouts, trainer, reference, tmp_path):
    """The engine's layer 0 input norm with epsilon 1e-6 (the model's is 1e-5): the same tokens are sampled,
    their logprobs move by up to ~2e-3, and the fp64 reference puts it on the engine (A)."""
    checkpoint, files = rollouts
    samples, _ = generate(checkpoint, eps_layer=0)
    planted = tmp_path / "eps.jsonl"
    planted.write_text("\n".join(map(json.dumps, jsonl(samples))))
    assert rollout_tokens(planted) == rollout_tokens(files["rollout.jsonl"])  # the trainer's run serves
    result, rows = compare(tmp_path, planted, trainer("--cp", "2"), "--reference", reference)
    assert result.exit_code == 1, result.output
    assert rows["logprobs"]["status"] == "fail" and rows["logprobs"]["reference"]["off"] == "A"
    assert "A off" in result.output


def test_unknown_file_is_one_line(rollouts, trainer, tmp_path):
    checkpoint, files = rollouts
    for args in (("compare", files["twin-unknown.jsonl"], trainer("--cp", "2")),
                 ("forward", "--hf", checkpoint, "--rollout", files["twin-unknown.jsonl"], "--out", tmp_path / "o")):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "not a rollout file" in lines[0] and "input, output, score, step" in lines[0]
        assert [f.name for f in ROLLOUT_FORMATS if f.name not in lines[0]] == []  # slime's too, once left out
    assert not (tmp_path / "o").exists()


def _leaves(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, path + (key,))
    elif isinstance(value, list) and value:
        yield from _leaves(value[-1], path + (len(value) - 1,))  # the last entry: the first is often null
    yield path


def _replaced(content, path, new):
    if not path:
        return new
    copy = list(content) if isinstance(content, list) else dict(content)
    copy[path[0]] = _replaced(content[path[0]], path[1:], new)
    return copy


@pytest.mark.parametrize("name", FORMATS)
def test_a_damaged_file_is_refused_in_one_line(rollouts, tmp_path, name):
    """Every field of every format replaced by a value of another type: read, or refused (UserError), never a
    traceback."""
    from megalign.errors import UserError

    checkpoint, files = rollouts
    text = files[name].read_text()
    lines = name.endswith(".jsonl")
    content = [json.loads(line) for line in text.splitlines()] if lines else json.loads(text)
    damaged = tmp_path / name
    for path in set(_leaves(content)):
        for new in ("x", None, -1, [], {}, [["x"]]):
            changed = _replaced(content, path, new)
            damaged.write_text("\n".join(map(json.dumps, changed)) if lines and isinstance(changed, list)
                               else json.dumps(changed))
            try:
                read_rollout(damaged, checkpoint)
            except UserError:
                pass


def test_findings_in_json_and_where_the_mismatch_sits(rollouts, trainer, tmp_path):
    """The real engine's gap (KV-cache decode against a full forward) spreads evenly: no region is
    over-represented; the findings are in the --json summary."""
    _, files = rollouts
    result, _ = compare(tmp_path, files["sglang.json"], trainer("--cp", "2"))
    assert result.exit_code == 0, result.output
    found = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])["rollout"]
    assert [g["sequence"] for g in found["worst_by_k3"]] == [0, 1] and found["causes"] == []
    assert not found["causes_checked"] and found["sides"] is None
    where = {r["name"]: r for r in found["where"]}
    assert {"positions 0-15", "first response token", "CP shard edges (CP=2)"} <= set(where)
    assert where["first response token"]["tokens"] == 2 and not any(r["over_represented"] for r in found["where"])
    assert "where the mismatch sits" in result.output


def test_a_gap_at_the_first_response_token_is_over_represented_there(rollouts, trainer, tmp_path):
    """The twin: the first response token's logprob off by 0.5 in each sequence, exit 1; the first
    response token holds all of the gap's mass, the rest of the response none of it."""
    _, files = rollouts
    lines = [json.loads(line) for line in files["rollout.jsonl"].read_text().splitlines()]
    for line in lines:
        line["response_logprobs"][0] += 0.5
    planted = tmp_path / "first.jsonl"
    planted.write_text("\n".join(map(json.dumps, lines)))
    result, _ = compare(tmp_path, planted, trainer("--cp", "2"))
    assert result.exit_code == 1, result.output
    where = {r["name"]: r for r in json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])["rollout"]["where"]}
    first = where["first response token"]
    assert first["over_represented"] and first["mass_share"] > 0.99 and first["token_share"] == 2 / 32
    assert not where["CP shard edges (CP=2)"]["over_represented"]
    assert "first response token        2       6.2%   100.0%" in result.output


def test_export_worst_writes_a_tokens_file_forward_runs(rollouts, trainer, tmp_path):
    checkpoint, files = rollouts
    worst = tmp_path / "worst.json"
    earlier = {"tokens": [[1, 2]], "sequences": [0], "prompt_lengths": [1], "rollout": "older.json",
               "worst_by_k3": [0], "worst_by_max_abs_diff": [0]}
    worst.write_text(json.dumps(earlier))  # an earlier export: replaced, as --json replaces its report
    result, rows = compare(tmp_path, files["vllm.json"], trainer("--cp", "2"), "--export-worst", "1", worst)
    assert result.exit_code == 0, result.output
    exported = json.loads(worst.read_text())
    by_k3, by_max = exported["worst_by_k3"], exported["worst_by_max_abs_diff"]
    assert exported["sequences"] == sorted(set(by_k3 + by_max)) and len(by_k3) == len(by_max) == 1
    samples = rollout_tokens(files["vllm.json"])
    assert exported["tokens"] == [samples[i] for i in exported["sequences"]]
    assert not list(tmp_path.glob(".worst.json.megalign-*"))  # written beside, renamed into place
    run = invoke("forward", "--stack", "hf", "--hf", checkpoint, "--tokens", worst, "--out", tmp_path / "repro")
    assert run.exit_code == 0, run.output
    # Its refusals, each one line, exit 2: N below 1, no rollout file, a path inside an input.
    (tmp_path / "notes.json").write_text("[[1, 2, 3]]")  # a user's own tokens file
    for args, words in ((("--export-worst", "0", worst), "N must be at least 1"),
                        (("--export-worst", "1", trainer("--cp", "2") / "w.json"), "inside the input"),
                        (("--export-worst", "1", tmp_path / "notes.json"), "is not a megalign worst-sequences file")):
        refused = invoke("compare", files["vllm.json"], trainer("--cp", "2"), *args)
        assert refused.exit_code == 2 and words in refused.output and len(refused.output.splitlines()) == 1
    refused = invoke("compare", trainer("--cp", "2"), trainer("--cp", "2", "--packed", "--attention", "torch"),
                     "--export-worst", "1", tmp_path / "w.json")
    assert refused.exit_code == 2 and "neither A nor B is a rollout file" in refused.output


def test_a_dump_folder_named_like_a_rollout_file_is_a_dump(trainer, tmp_path):
    """A folder is never a rollout file, whatever its name: a dump saved as run.json compares as a dump."""
    named = tmp_path / "run.json"
    shutil.copytree(trainer("--cp", "2"), named)
    result = invoke("compare", named, trainer("--cp", "2"), "--format", "plain")
    assert result.exit_code == 0, result.output
    assert "rollout" not in result.output.splitlines()[0]


@pytest.mark.parametrize("emptied", ("loss_mask 0", "no response"))
def test_a_rollout_with_nothing_to_compare_is_refused_up_front(rollouts, trainer, tmp_path, emptied):
    """Every loss_mask 0, or every response empty: compare, forward --rollout and backward --rollout all refuse
    it in one line, exit 2, before anything runs or is written (compare said "3 passed" of nothing)."""
    checkpoint, files = rollouts
    lines = [json.loads(line) for line in files["rollout.jsonl"].read_text().splitlines()]
    for line in lines:
        if emptied == "loss_mask 0":
            line["loss_mask"] = [0] * len(line["response_ids"])
        else:
            line["response_ids"], line["response_logprobs"] = [], []
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n".join(map(json.dumps, lines)))
    for args in (("compare", empty, trainer("--cp", "2")),
                 ("forward", "--hf", checkpoint, "--rollout", empty, "--out", tmp_path / "f"),
                 ("backward", "--hf", checkpoint, "--rollout", empty, "--out", tmp_path / "b")):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert "no response token to compare" in error_line(result)
    assert not (tmp_path / "f").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("value", (-math.inf, math.nan))
def test_a_non_finite_logprob_prints_as_inf_never_as_float_max(rollouts, trainer, tmp_path, value):
    """One response logprob -inf (Python's json writes -Infinity) or NaN: every figure of its gap is inf, on
    the row, in the worst sequences and where the mismatch sits (it printed 1.8e+308, k3 7.49e+306, nan%)."""
    _, files = rollouts
    lines = [json.loads(line) for line in files["rollout.jsonl"].read_text().splitlines()]
    lines[0]["response_logprobs"][3] = value
    planted = tmp_path / "non-finite.jsonl"
    planted.write_text("\n".join(map(json.dumps, lines)))
    result, rows = compare(tmp_path, planted, trainer("--cp", "2"))
    assert result.exit_code == 1, result.output
    assert rows["logprobs"]["status"] == "fail"
    assert "e+30" not in result.output and "nan%" not in result.output, result.output
    assert "|Δlogprob| max inf mean inf p99 inf (seq 0 pos 7" in result.output and "k3 KL inf;" in result.output
    assert "p99 inf;" in result.output  # the ratio p_B/p_A past float64, not exp(700)
    worst = result.output.split("worst sequences by k3 KL")[1].splitlines()[3].split()
    assert worst[:5] == ["0", "16", "inf", "inf", "@7"], result.output
    where = next(line for line in result.output.splitlines() if line.startswith("positions 0-15"))
    assert where.split()[4:7] == ["100.0%", "inf", "inf"], where


@pytest.mark.parametrize("planted, cause", (
    ("offset -0.2", "cause: a constant offset: the rollout's logprobs are the trainer's -0.2 on every token"),
    ("raised 24", "cause: impossible logprobs: 1 of the rollout's 32 above 0 by more than rounding (0.001), a "
     "probability above 1 (the largest "),
    ("raised 0.5", "cause: none of the known ones"),
))
def test_an_offset_a_positive_logprob_and_one_raised_token_are_told_apart(rollouts, trainer, tmp_path, planted, cause):
    """-0.2 on every response logprob is the documented constant offset; one raised by 24 (now above 0) is
    impossible, said before any sampling cause; one raised by 0.5 (still below 0) is no renormalisation. The
    last two were called top-p/top-k renormalisation."""
    _, files = rollouts
    lines = [json.loads(line) for line in files["rollout.jsonl"].read_text().splitlines()]
    if planted == "offset -0.2":
        for line in lines:
            line["response_logprobs"] = [v - 0.2 for v in line["response_logprobs"]]
    else:
        lines[0]["response_logprobs"][3] += float(planted.split()[1])
    path = tmp_path / "planted.jsonl"
    path.write_text("\n".join(map(json.dumps, lines)))
    result, rows = compare(tmp_path, path, trainer("--cp", "2"))
    assert result.exit_code == 1 and rows["logprobs"]["status"] == "fail", result.output
    assert [line for line in result.output.splitlines() if line.startswith("cause:")] == [
        next(line for line in result.output.splitlines() if line.startswith(cause))], result.output
    assert "renormalisation:" not in result.output


def test_a_wrong_prompt_logprob_is_shown_on_its_failing_row(rollouts, trainer, tmp_path):
    """The row's RL figures are over the response (the loss mask): a prompt logprob 0.5 off failed the row while
    they stayed at noise. The row now says where it failed, outside the loss mask."""
    _, files = rollouts
    content = json.loads(files["sglang.json"].read_text())
    content[0]["meta_info"]["input_token_logprobs"][2][0] -= 0.5  # the logprob of prompt token 2, at position 1
    planted = tmp_path / "prompt.json"
    planted.write_text(json.dumps(content))
    result, rows = compare(tmp_path, planted, trainer("--cp", "2"))
    assert result.exit_code == 1, result.output
    logprobs = rows["logprobs"]
    assert logprobs["status"] == "fail" and logprobs["logprobs"]["max_abs_diff"] < 1e-4
    assert abs(logprobs["logprobs"]["outside_max_abs_diff"] - 0.5) < 1e-4
    assert (logprobs["logprobs"]["outside_sequence"], logprobs["logprobs"]["outside_position"]) == (0, 1)
    assert "outside the loss mask |Δlogprob| max 0.5 (seq 0 pos 1, token " in result.output, result.output
    result, rows = compare(tmp_path, files["sglang.json"], trainer("--cp", "2"))
    assert result.exit_code == 0 and "outside the loss mask" not in result.output, result.output
