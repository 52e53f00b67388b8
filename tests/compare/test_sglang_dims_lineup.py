"""sglang dumps whose two sides lay the same tensor out differently, written by sglang's own dumper
(sglang_forms_writer.py): dims fused against split, a squeeze dim, another dim order; THD rows of two
sequences zigzagged over CP each on its own; an sglang server's prefill and decode passes against
megatron's THD forward. Each correct pair passes, and each with one rank's shard 1% off fails at it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import invoke

from megalign.compare.sources.sglang_server import new_tokens

WRITER = Path(__file__).with_name("sglang_forms_writer.py")


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> Path:
    """Every form, correct and planted, written once (one process: sglang's dumper is slow to import)."""
    out = tmp_path_factory.mktemp("forms")
    result = subprocess.run([sys.executable, str(WRITER), str(out)], capture_output=True, text=True, timeout=600,
                            cwd=WRITER.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def written(forms: Path, form: str, planted: bool) -> tuple[Path, Path]:
    folder = forms / form / ("planted" if planted else "ok")
    return folder / "a/exp", folder / "b/exp"


def compare(tmp_path, a, b):
    report = tmp_path / "r.jsonl"
    result = invoke("compare", a, b, "--json", report)
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    return result, {row["name"]: row for row in lines[:-1]}, lines[-1]


# form -> (the tensor's name, its shape once lined up: B's dims, squeeze dims dropped, fused dims fused)
FORMS = {
    "fused": ("attn", [6, 12]),  # t num_heads head_dim against t (num_heads*head_dim)[tp]
    "squeezed": ("attn", [6, 12]),  # t h against t 1 h[tp]
    "reordered": ("attn", [6, 3, 4]),  # b h d against b d h[tp]
    "thd_zigzag": ("attn", [12, 12]),  # t h against t[cp:zigzag] h, cu_seqlens_q [0, 8, 12]
    "server_against_thd": ("hidden", [12, 12]),  # prefill + 3 decode passes against t h[tp], 8 + 4 tokens
}


@pytest.mark.parametrize("form", FORMS)
def test_a_correct_pair_passes_and_a_planted_shard_fails_at_its_tensor(forms, tmp_path, form):
    name, shape = FORMS[form]
    result, rows, summary = compare(tmp_path, *written(forms, form, planted=False))
    assert result.exit_code == 0, result.output
    assert rows[name]["status"] == "pass" and rows[name]["shape_a"] == rows[name]["shape_b"] == shape, rows[name]
    assert summary["compared"] == summary["passed"] == len(rows)
    planted, rows, summary = compare(tmp_path, *written(forms, form, planted=True))
    assert planted.exit_code == 1, planted.output
    assert summary["first_divergence"] == f"activation {name}" and rows[name]["status"] == "fail"
    assert summary["failed"] == 1  # tokens and positions, lined up alike, still pass


def test_the_server_side_lines_its_requests_up_with_megatrons_packed_sequences(forms, tmp_path):
    """sglang's seq_lens as each pass's new tokens (prefill [5, 1], then [1, 1]) cut a's 8 and b's 4
    tokens; both orders compare the same."""
    a, b = written(forms, "server_against_thd", planted=False)
    result, rows, _ = compare(tmp_path, b, a)
    assert result.exit_code == 0, result.output
    assert {"tokens", "position_ids", "hidden"} == set(rows)
    assert "sglang server dump: 4 passes, 2 requests, 12 tokens" in result.output


def test_seq_lens_are_new_tokens_only_where_they_add_up_to_the_pass():
    """A length so far is at least the request's new tokens: lengths that add up to the pass's tokens
    are its new tokens whichever the meaning; others (a server's decode: [9, 7] for 2 tokens) are not."""
    assert new_tokens([5, 1], 6) == [5, 1]
    assert new_tokens([1, 1], 2) == [1, 1]
    assert new_tokens([9, 7], 2) is None
    assert new_tokens([7, 5], 3) is None  # a mixed pass: a decodes, b extends after its cached prefix


def test_thd_zigzag_without_the_sequences_bounds_is_not_reassemblable(forms, tmp_path):
    """Undoing the zigzag over the whole row would misplace every token: without cu_seqlens_q (as sglang's
    comparator, which refuses it) the tensor is not put together, and the run fails saying why."""
    a, b = written(forms, "thd_zigzag", planted=False)
    b = shutil.copytree(b, tmp_path / "b")
    for file in b.glob("*name=cu_seqlens_q*"):
        file.unlink()
    result, rows, _ = compare(tmp_path, a, b)
    assert result.exit_code == 1 and rows["attn"]["status"] == "not_reassemblable", result.output
    assert "the step records no cu_seqlens_q" in result.output
