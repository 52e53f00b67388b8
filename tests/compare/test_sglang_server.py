"""sglang dumper dumps of a server (compare/sources/sglang_server.py), written by sglang's own dumper code
(sglang_server_writer.py): chunked prefill, a cached prefix, a mixed pass and decode passes of two requests,
lined up by request and position; two requests' decode steps swapped are caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalign.compare.sources.sglang_server import fill_prefixes, open_server_dump

WRITER = Path(__file__).with_name("sglang_server_writer.py")
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
    # b alone: its cached prefix was computed by no request in the dump.
    only_b = open_server_dump(written["plain"])
    only_b.requests = [r for r in only_b.requests if r.rid == "b"]
    assert "positions 0-2 were not computed for it; no request computed them" in fill_prefixes(only_b)
