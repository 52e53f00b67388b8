"""Fixtures of the compare tests: copies of real dumps with a planted bug, and sglang-format dumps
written by sglang's own dumper (tests/compare/sglang_writer.py) from real megalign dumps."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from megalign.dump.format import MANIFEST
from megalign.dump.reader import DumpFiles

WRITER = Path(__file__).with_name("sglang_writer.py")
# The default tiny backward at CP=1 / CP=2, shared with the run tests through conftest's `dump`.
CP1 = ("backward",)
CP2 = ("backward", "--cp", "2")
CP2_LOCAL = ("backward", "--cp", "2", "--loss-norm", "local")
TP2 = ("backward", "--tp", "2")


def copy_dump(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def perturb(dump_dir: Path, kind: str, name: str, rank: int, scale: float = 1e-3, at: int = 0) -> None:
    """Add `scale` to element `at` (flat index) of one rank's shard of a tensor, in its safetensors file."""
    manifest = json.loads((dump_dir / f"rank-{rank:05d}" / MANIFEST).read_text())
    record = next(r for r in manifest["tensors"] if r["kind"] == kind and r["name"] == name)
    file = dump_dir / f"rank-{rank:05d}" / record["file"]
    tensors = load_file(str(file))
    tensors[record["key"]].view(-1)[at] += scale
    save_file(tensors, str(file))


@pytest.fixture(scope="session")
def sglang_dump(tmp_path_factory):
    """`sglang_dump(megalign_dump_dir)` -> an sglang dumper folder holding the same tensors."""
    made: dict[Path, Path] = {}

    def make(source: Path) -> Path:
        if source not in made:
            out = tmp_path_factory.mktemp("sglang")
            ranks = DumpFiles.open(source).meta["world_size"]
            result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node", str(ranks), str(WRITER), str(source), str(out)],
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr[-4000:]
            made[source] = out
        return made[source]

    return make
