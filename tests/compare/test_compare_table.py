"""The terminal table (`--format table`) at 80, 120 and 200 columns: never a number cut, never a name
lost, the least useful columns giving way first, and the dtypes said once above the table. With
--no-color or NO_COLOR, a terminal gets no style at all."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
import sys

import pytest
import torch
from compare_fixtures import CP1, copy_dump
from conftest import invoke, rescale
from rich.cells import cell_len
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def report(dump, tmp_path_factory):
    """fp32 against bf16 gradients times 1.5: long names, failures with notes, other dtypes."""
    scaled = copy_dump(dump("backward", "--dtype", "bf16"), tmp_path_factory.mktemp("table") / "scaled")
    rescale(scaled, "param_grad", 1.5)
    return dump(*CP1), scaled


def table(report, width: int, tmp_path):
    out = tmp_path / "r.jsonl"
    result = invoke("compare", *report, "--format", "table", "--json", out, env={"COLUMNS": str(width)})
    assert result.exit_code == 1, result.output
    return result.output, [json.loads(line) for line in out.read_text().splitlines()[:-1]]


def columns(output: str) -> tuple[list[str], str, list[str]]:
    """The table's lines (notes under it included), its header line of column names, its body lines."""
    lines = output.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("─"))
    start, end = lines.index("") + 1, lines.index("", rule)
    notes = next((i for i in range(rule, end) if lines[i].startswith("notes (")), end)
    return lines[start:end], lines[rule - 1], lines[rule + 1:notes]


def names(header: str, body: list[str]) -> list[str]:
    """Each row's name, its folded pieces joined: a row starts where the # column has a number."""
    start, end, first = header.index("name"), header.index("shape"), header.index("kind")
    rows: list[str] = []
    for line in body:
        piece = line[start:end].strip()
        if line[:first].strip():
            rows.append(piece)
        else:
            rows[-1] += piece
    return rows


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_table_fits_the_terminal_and_cuts_nothing(report, width, tmp_path):
    output, rows = table(report, width, tmp_path)
    lines, header, body = columns(output)
    assert max(map(cell_len, lines)) <= width  # the source lines above it are the terminal's to wrap
    assert names(header, body) == [r["name"] for r in rows]
    words = set(" ".join(body).split())
    for r in rows:
        m = r["metrics"]
        assert _shape_text(r) in words and f"{m['rel_diff']:.3g}" in words and f"{m['max_abs_diff']:.3g}" in words
    assert output.count("compared in float64") == 1
    # What gives way, least useful first: the note goes under the table, then the threshold column.
    notes = [f"{r['order']}: {note}" for r in rows for note in r["notes"]]
    assert notes and all(("rescaled" in note) for note in notes)
    assert ("note" in header.split()) == ("thr" in header.split()) == (width == 200)
    if width < 200:
        assert all(note in output for note in notes)


def _shape_text(row: dict) -> str:
    return "x".join(map(str, row["shape_a"])) if row["shape_a"] else "scalar"


def test_a_terminal_too_narrow_for_any_table_gets_plain_text(report, tmp_path):
    """At 60 columns no narrowing step is enough: rich squeezed the columns and split numbers
    (0.00012 as "0.0001" over "2"). Plain text is printed instead, every cell whole on its line."""
    out = tmp_path / "r.jsonl"
    result = invoke("compare", *report, "--format", "table", "--json", out, env={"COLUMNS": "60"})
    assert result.exit_code == 1, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()[:-1]]
    lines = result.output.splitlines()
    for i, r in enumerate(rows):
        line = next(line for line in lines if line.split()[:1] == [str(i)] and r["name"] in line.split())
        assert f"{r['metrics']['rel_diff']:.3g}" in line.split() and _shape_text(r) in line.split()


def in_a_terminal(*args, env: dict) -> str:
    """What `megalign ARGS` writes, stdout and stderr, to a colour terminal (a pseudo-terminal): a pipe
    gets no styles whatever the options."""
    leader, follower = pty.openpty()
    base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    process = subprocess.Popen([sys.executable, "-m", "megalign", *map(str, args)], stdin=subprocess.DEVNULL,
                               stdout=follower, stderr=follower, env={**base, "TERM": "xterm-256color", **env})
    os.close(follower)
    written = b""
    with contextlib.suppress(OSError):  # EIO once the command has closed the terminal
        while chunk := os.read(leader, 1 << 16):
            written += chunk
    os.close(leader)
    process.wait(timeout=120)
    return written.decode()


def test_no_color_is_no_style_in_a_terminal(tmp_path):
    """rich's no_color dropped the colours and kept bold: the report's `A`, the error's `error:`."""
    tensor_files = tmp_path / "files"
    tensor_files.mkdir()
    save_file({"x": torch.ones(3)}, str(tensor_files / "a.safetensors"))
    assert "\x1b[1mA" in in_a_terminal("compare", tensor_files, tensor_files, env={})
    for options, env in (((), {"NO_COLOR": "1"}), (("--no-color",), {})):
        report = in_a_terminal("compare", tensor_files, tensor_files, *options, env=env)
        error = in_a_terminal("compare", tensor_files, tmp_path / "missing", *options, env=env)
        assert "all compared tensors within threshold" in report and "error:" in error, report + error
        assert "\x1b[" not in report + error, (options, env, repr(report + error))
