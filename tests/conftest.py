"""Shared fixtures: the real CLI, and dumps made once per session by real megatron-core workers.

Each launch costs 6-15 s on two cores (mostly imports), so every dump that several tests read is
made once, keyed by the run it makes: its options as `megalign MODE` reads them, defaults filled in,
--out left out (`backward` and `backward --cp 1` share one dump).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest
import torch
from filelock import FileLock  # torch's own dependency
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

# pytest-xdist's workers export COLUMNS=80 and LINES=24; rich would fix the CLI consoles' size from them when
# megalign is imported, and the tests give each invocation its own COLUMNS (a terminal 60 to 200 wide).
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

from megalign.compare.sources import open_source  # noqa: E402
from megalign.dump.format import MANIFEST  # noqa: E402
from megalign.dump.sketch import decode, encode  # noqa: E402
from megalign.cli.app import app  # noqa: E402
from megalign.cli.run import parse_run  # noqa: E402
from megalign.options import RunConfig  # noqa: E402


def invoke(*args: str, env: Optional[dict[str, str]] = None):
    """Run `megalign ARGS` in-process through Typer, as a user would type it (with `env` set, e.g. COLUMNS)."""
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def at_80_columns(a: Path, b: Path, out: Path) -> tuple[str, list[dict]]:
    """`megalign compare A B` in a terminal 80 columns wide: its output, and its --json records (in `out`)."""
    result = invoke("compare", a, b, "--format", "table", "--json", out, env={"COLUMNS": "80"})
    assert result.exit_code in (0, 1), result.output
    return result.output, [json.loads(line) for line in out.read_text().splitlines()]


def assert_whole(output: str, records: list[dict], width: int = 80) -> None:
    """A report that reads whole in a terminal `width` wide: no line wider, no ellipsis; every name of
    the table whole over its folded lines; the lines around it (each side with its gradient convention,
    the notes under the table, the summary) wrapped between words, so that joined they hold the --json
    report's words as written."""
    from rich.cells import cell_len

    def joined(lines: list[str]) -> str:
        return " ".join(" ".join(lines).split())

    lines, (*rows, summary) = output.splitlines(), records
    assert max(map(cell_len, lines)) <= width and "…" not in output, output
    rule = next(i for i, line in enumerate(lines) if line.startswith("─"))  # under the column names
    top, end = lines.index(""), lines.index("", rule)
    header = lines[rule - 1]
    assert joined(lines[:top]) == joined([f"{side.upper()} {summary[side]['path']}: {summary[side]['description']}"
                                          for side in "ab"]), output
    notes = next((i for i in range(rule, end) if lines[i].startswith("notes (")), end)
    name, shape, kind = header.index("name"), header.index("shape"), header.index("kind")
    names: list[str] = []
    for line in lines[rule + 1:notes]:
        if line[:kind].strip():
            names.append("")
        names[-1] += line[name:shape].strip()
    assert names == [row["name"] for row in rows], output
    assert joined(lines[notes + 1:end]) == joined([f"{row['order']}: {'; '.join(row['notes'])}" for row in rows
                                                   if row["notes"]]), output
    said = joined(lines[end + 1:])
    first = summary["first_divergence"]
    expected = [f"{summary['compared']} compared, {summary['passed']} passed, {summary['failed']} failed"] + \
        ([f"first divergence: {first}", "first failure per kind: " + "; ".join(
            f"{kind} {name}" for kind, name in summary["first_failure_by_kind"].items())] if first else [])
    assert all(text in said for text in expected), output


def error_line(result, traceback: bool = False) -> str:
    """The one `error:` line; a traceback only where a worker crashed (the failing rank's own)."""
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    assert ("Traceback" in result.output) == traceback, result.output
    return lines[0]


def run_key(mode: str, *args: str) -> RunConfig:
    """The run `megalign MODE ARGS` makes, however it is spelled: its RunConfig without --out."""
    return replace(parse_run(mode, [str(a) for a in args]), out=None)


def shared_folder(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this run sees (their basetemps' parent is the run's own),
    so that a dump two workers' tests read is made once; without xdist, this session's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def dump(tmp_path_factory):
    """`dump("backward", "--cp", "2")` -> the folder of that run's dump, made once per test run: the
    first worker to ask makes it (under a lock), the others wait and read it."""
    made: dict[RunConfig, Path] = {}
    folder = shared_folder(tmp_path_factory) / "dumps"
    folder.mkdir(exist_ok=True)

    def make(*args: str) -> Path:
        key = run_key(*args)
        if key not in made:
            out = folder / hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            with FileLock(f"{out}.lock"):
                if not out.is_dir():  # a failed run leaves none: the next asker runs it again
                    result = invoke(*args, "--out", out)
                    assert result.exit_code == 0, result.output
            made[key] = out
        return made[key]

    return make


def tensors(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every tensor of a dump, reassembled from its shards by the product's own reader."""
    source = open_source(path)
    return {(e.kind, e.name): e.load().tensor for e in source.entries}


def max_abs_diffs(a: Path, b: Path, kinds=None) -> dict[tuple[str, str], float]:
    """Max |a - b| for every tensor both dumps hold (optionally of the given kinds)."""
    ta, tb = tensors(a), tensors(b)
    common = [k for k in ta if k in tb and (kinds is None or k[0] in kinds)]
    return {k: (ta[k].double() - tb[k].double()).abs().max().item() for k in common}


def rescale(dump_dir: Path, kind: str, factor: float, names: str = "") -> None:
    """Multiply every tensor of `kind` (whose name matches the regex `names`) by `factor` in every rank's
    files (or --stats-only records), as a loss normalised over another count of tokens does; each value
    is rounded to its own dtype."""
    for path in dump_dir.glob("rank-*/" + MANIFEST):
        manifest = json.loads(path.read_text())
        records = [r for r in manifest["tensors"] if r["kind"] == kind and re.search(names, r["name"])]
        for r in records:
            if r["stats"] is not None:
                r["stats"].update({k: r["stats"][k] * factor for k in ("sum", "abs_sum", "min", "max")},
                                  sum_sq=r["stats"]["sum_sq"] * factor ** 2)
            if r.get("sketch") is not None:  # linear in the values
                r["sketch"] = encode(decode(r["sketch"]) * factor)
        path.write_text(json.dumps(manifest))
        for name in {r["file"] for r in records if r["file"]}:
            tensors = load_file(str(path.parent / name))
            for r in records:
                if r["file"] == name:
                    tensors[r["key"]] = (tensors[r["key"]].double() * factor).to(tensors[r["key"]].dtype)
            save_file(tensors, str(path.parent / name))
