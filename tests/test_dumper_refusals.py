"""What megalign.Dumper refuses at once, so that nothing is lost later and nothing unreadable is
written: a tensor no dump can hold (at add(), the rest of the dump landing), a forked child's use of
its parent's Dumper.

Written as a user writes a script: megalign.Dumper's public API, each dump read back and compared
with the real CLI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import megalign
from tests.conftest import invoke
from tests.test_api import REPO

STORED = ("dense tensors of float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int64, int32, int16, "
          "int8, uint8, bool, with values")
# Each tensor a dump cannot hold, and what the refusal calls it.
UNSTORABLE = {
    "complex64": (lambda: torch.ones(2, dtype=torch.complex64), "a complex64 tensor"),
    "uint16": (lambda: torch.ones(2, dtype=torch.uint16), "a uint16 tensor"),
    "uint32": (lambda: torch.ones(2, dtype=torch.uint32), "a uint32 tensor"),
    "qint8": (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "a qint8 tensor"),
    "fnuz": (lambda: torch.ones(2).to(torch.float8_e4m3fnuz), "a float8_e4m3fnuz tensor"),
    "meta": (lambda: torch.ones(2, device="meta"), "a tensor on the meta device"),
    "sparse": (lambda: torch.eye(2).to_sparse(), "a tensor of layout torch.sparse_coo"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
               "a nested tensor"),
}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # deprecated; users still have qint8 tensors
@pytest.mark.parametrize("stats_only", [False, True])
def test_a_tensor_no_dump_can_hold_is_refused_at_add_and_the_rest_lands(tmp_path, stats_only):
    """complex64, uint32, ... were taken, and close() lost the whole dump (stats-only: wrote one that
    nothing could read); sparse and nested tensors met torch's internal errors. Each is refused with one
    line, and the dump lands with the rest: float8 too, values or statistics, judged both ways."""
    h = torch.linspace(-1, 1, 8)
    for run, scale in (("a", 1.0), ("b", 2.0)):
        with megalign.Dumper(tmp_path / run, stats_only=stats_only) as dumper:
            dumper.add("activation", "h", h)
            for name, (make, said) in UNSTORABLE.items():
                with pytest.raises(TypeError) as refused:
                    dumper.add("activation", name, make())
                assert str(refused.value) == f"activation {name}: megalign stores {STORED}; got {said}"
            dumper.add("activation", "h8", (h * scale).to(torch.float8_e4m3fn))
    assert megalign.open(tmp_path / "a").names() == [("activation", "h"), ("activation", "h8")]
    result = invoke("compare", tmp_path / "a", tmp_path / "a")
    assert result.exit_code == 0, result.output
    result = invoke("compare", tmp_path / "a", tmp_path / "b")  # the planted bug: h8 doubled
    assert result.exit_code == 1, result.output
    assert "first divergence: activation h8\n" in result.output


# A user's script that forks while its Dumper is open: one child only exits (sys.exit, its at-exit hooks
# run), the other tries the parent's Dumper; the parent goes on and closes it.
FORKS = """
import os, sys
import torch
import megalign

with megalign.Dumper(sys.argv[1]) as dumper:
    dumper.add("loss", "before", torch.tensor(1.5))
    if os.fork() == 0:
        sys.exit(0)
    os.wait()
    if os.fork() == 0:
        def step():
            with dumper.step(0):
                pass

        for use in (lambda: dumper.add("loss", "child", torch.tensor(9.0)), step, dumper.close):
            try:
                use()
            except RuntimeError as error:
                print(error, flush=True)
        sys.exit(0)
    os.wait()
    print(sorted(p.name for p in os.scandir(os.path.dirname(sys.argv[1]))), flush=True)
    dumper.add("loss", "after", torch.tensor(2.5))
"""


def test_a_forked_child_neither_removes_nor_writes_its_parents_dump(tmp_path):
    """The child's exit ran the Dumper's at-exit hook, and its copy of the claimed staging folder's
    context was closed: the parent's OUT.partial was removed, and its close() failed. A child that used
    the Dumper landed the parent's dump. Now only the process that made the Dumper touches it."""
    (tmp_path / "forks.py").write_text(FORKS)
    out = tmp_path / "dumps" / "mine"
    done = subprocess.run([sys.executable, "forks.py", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and lines[3] == "['mine.partial']", done.stdout  # intact after both children
    for line, call in zip(lines, ("add", "step", "close")):
        assert re.fullmatch(rf"megalign.Dumper\({re.escape(repr(str(out)))}\) is process \d+'s; {call}\(\) in "
                            r"process \d+, a fork of it, would mix into its dump or lose it \(make a Dumper of this "
                            r"process's own, with another out\)", line), line
    assert "never closed" not in done.stderr
    assert megalign.open(out).names() == [("loss", "before"), ("loss", "after")]
    assert sorted(p.name for p in out.parent.iterdir()) == ["mine"]
