"""sglang dumper dumps of a server (compare/sources/sglang_server.py), written by sglang's own dumper code
(sglang_server_writer.py): chunked prefill, a cached prefix, a mixed pass and decode passes of two requests,
lined up by request and position; two requests' decode steps swapped are caught.

Then transformers' `generate` on the real SmolLM2 checkpoint as the server (sglang_generate_writer.py),
compared by `megalign compare` with `megalign forward --stack hf` of the same tokens, layer by layer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import error_line, invoke
from real_checkpoint import build

from megalign.compare.sources.sglang_server import fill_prefixes, open_server_dump

WRITER = Path(__file__).with_name("sglang_server_writer.py")
GENERATE = Path(__file__).with_name("sglang_generate_writer.py")
A = [11, 12, 13, 14, 15, 16, 31, 32, 33]
B = [11, 12, 13, 24, 25, 41, 42]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{"plain": folder, "swap": folder}: the passes as written, and with the last pass's rows swapped."""
    folders = {}
    for kind in ("plain", "swap"):
        out = tmp_path_factory.mktemp(kind)
        result = subprocess.run([sys.executable, str(WRITER), str(out)] + ([kind] if kind == "swap" else []),
                                capture_output=True, text=True, timeout=300, cwd=WRITER.parent)
        assert result.returncode == 0, result.stderr[-3000:]
        folders[kind] = out / "exp"
    return folders


def expected(tokens_by_request):
    """What the toy engine computes for every token: [token, position], zero past a request's end."""
    width = max(map(len, tokens_by_request))
    out = torch.zeros(len(tokens_by_request), width, 2)
    for i, tokens in enumerate(tokens_by_request):
        for p, t in enumerate(tokens):
            out[i, p] = torch.tensor([float(t), float(p)])
    return out


def test_passes_line_up_by_request_and_position(written):
    dump = open_server_dump(written["plain"])
    assert [r.rid for r in dump.requests] == ["a", "b"]
    assert fill_prefixes(dump) is None  # b's cached prefix is a's first 3 tokens
    assert dump.tokens() == [A, B]
    assert torch.equal(dump.lined_up("hidden"), expected([A, B]))


def test_two_requests_decode_steps_swapped_are_caught(written):
    dump = open_server_dump(written["swap"])
    fill_prefixes(dump)
    assert dump.tokens() == [A, B]  # the batch's metadata is right: only the rows are swapped
    wrong = (dump.lined_up("hidden") != expected([A, B])).any(dim=-1).nonzero().tolist()
    assert wrong == [[0, 8], [1, 6]]  # exactly the last pass's token of each request


def test_passes_that_do_not_fit_together_are_one_line(written, tmp_path):
    """A pass whose seq_lens claim a position its tokens never reach: refused (UserError: one line, exit 2)."""
    import shutil

    from megalign.errors import UserError

    copy = shutil.copytree(written["plain"], tmp_path / "exp")
    file = next(copy.glob("step=4___*___name=seq_lens___*.pt"))
    content = torch.load(file, weights_only=True)
    torch.save({**content, "value": torch.tensor([9, 8])}, file)
    with pytest.raises(UserError, match="step 4: request b's tokens end before position 7"):
        open_server_dump(copy)
    result = invoke("compare", copy, copy)  # through the CLI: one line, exit 2
    assert result.exit_code == 2 and "step 4: request b's tokens end before position 7" in error_line(result)
    # b alone: its cached prefix was computed by no request in the dump.
    only_b = open_server_dump(written["plain"])
    only_b.requests = [r for r in only_b.requests if r.rid == "b"]
    assert "positions 0-2 were not computed for it; no request computed them" in fill_prefixes(only_b)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """{"plain": folder, "swap": folder, "tokens": tokens.json}: generate's passes as a server dumps them, and
    with the two requests' rows of the last decode pass swapped (both processes at once)."""
    out = tmp_path_factory.mktemp("generate")
    build()  # once, here: both processes would otherwise build the checkpoint side by side
    runs = {kind: subprocess.Popen([sys.executable, str(GENERATE), str(out / kind), kind], cwd=GENERATE.parent,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for kind in ("plain", "swap")}
    for run in runs.values():
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]
    assert (out / "plain/tokens.json").read_text() == (out / "swap/tokens.json").read_text()
    return {"plain": out / "plain/exp", "swap": out / "swap/exp", "tokens": out / "plain/tokens.json"}


def compare(tmp_path, a, b):
    report = tmp_path / "r.jsonl"
    result = invoke("compare", a, b, "--json", report, "--format", "plain")
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    return result, {row["name"]: row for row in lines[:-1]}, lines[-1]


def test_generate_as_a_server_matches_megalign_forward_layer_by_layer(generated, dump, tmp_path):
    """Every layer's activations of the cached decode steps, lined up by token, and the next-token logits at
    the tokens they were computed for, against the full forward: exit 0, either order; the one-sided rows
    are the op map's (megatron's linear_qkv, labels, loss, ...)."""
    forward = dump("forward", "--stack", "hf", "--hf", build(), "--tokens", generated["tokens"])
    assert json.loads(generated["tokens"].read_text()) == open_server_dump(generated["plain"]).tokens()
    for a, b in ((generated["plain"], forward), (forward, generated["plain"])):
        result, rows, summary = compare(tmp_path, a, b)
        assert result.exit_code == 0, result.output
        assert "sglang server dump: 4 passes, 2 requests, 18 tokens" in result.output
        passed = {name for name, row in rows.items() if row["status"] == "pass"}
        layers = 30
        assert {"tokens", "position_ids", "embedding", "decoder.final_layernorm", "logits"} <= passed
        assert rows["logits"]["shape_a"][0] == 8  # next-token logits: 4 passes of 2 requests
        assert all(f"decoder.layers.{i}.{m}" in passed for i in range(layers) for m in (
            "input_layernorm", "self_attention.core_attention", "self_attention.linear_proj", "self_attention",
            "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2#input", "mlp.linear_fc2", "mlp"))
        assert all(f"decoder.layers.{i}" in passed for i in range(layers))  # sglang's MLP output + residual
        assert summary["compared"] == summary["passed"] == len(passed)


def test_two_requests_decode_steps_swapped_in_a_server_fail_at_their_tokens(generated, dump, tmp_path):
    forward = dump("forward", "--stack", "hf", "--hf", build(), "--tokens", generated["tokens"])
    result, rows, summary = compare(tmp_path, forward, generated["swap"])
    assert result.exit_code == 1, result.output
    assert summary["first_divergence"] == "activation embedding"
    # The real tokens, request after request: a's last (8) and b's last (17), the swapped pass's.
    worst = {row["metrics"]["max_abs_index"][0] for row in rows.values() if row["status"] == "fail" and row["kind"] ==
             "activation"}
    assert worst == {8, 17} and summary["failed"] == summary["compared"] - 2  # all but tokens and positions
    assert rows["logits"]["status"] == "fail" and rows["logits"]["metrics"]["max_abs_index"][0] in (3, 7)


def test_a_pass_without_its_logits_fails_in_one_line(generated, dump, tmp_path):
    """One pass's next-token logits deleted: the logits row cannot be put together, which fails (exit 1),
    named, and no traceback."""
    server = shutil.copytree(generated["plain"], tmp_path / "no-logits")
    dropped = list(server.rglob("step=2___*name=non_intrusive__logits_processor*"))
    assert dropped
    for file in dropped:
        file.unlink()
    forward = dump("forward", "--stack", "hf", "--hf", build(), "--tokens", generated["tokens"])
    result, rows, summary = compare(tmp_path, forward, server)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert rows["logits"]["status"] == "not_reassemblable" and "step 2 has no row" in result.output


@pytest.mark.parametrize("copy_as", ["rank=1", "dump_index=99999"])
def test_another_ranks_files_or_a_name_dumped_twice_are_one_line(written, tmp_path, copy_as):
    """A second rank's files would go unread, and of a name dumped twice in one pass only one judged:
    both are refused (one line, exit 2) rather than compared on part of the dump."""
    copy = shutil.copytree(written["plain"], tmp_path / "exp")
    file = next(copy.glob("step=4___*___name=input_ids___*.pt"))
    field = copy_as.split("=")[0]
    name = "___".join(copy_as if part.startswith(field + "=") else part for part in file.name.split("___"))
    shutil.copy(file, file.with_name(name))
    result = invoke("compare", copy, copy)
    assert result.exit_code == 2, result.output
    assert ("only one rank's are read" if field == "rank" else "dumped 'input_ids' twice") in error_line(result)
