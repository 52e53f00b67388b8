"""What megalign.Dumper refuses at once, so that nothing is lost later and nothing unreadable is
written: a tensor no dump can hold (at add(), the rest of the dump landing), a forked child's use of
its parent's Dumper, steps it cannot mean, a step written twice, a blank MEGALIGN_DUMP; and its
refusals speak of its own arguments, not the CLI's flags.

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
from megalign.errors import UserError
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


@pytest.mark.filterwarnings("ignore:megalign.Dumper")  # step 100 never runs: the dump holds no step, as meant
def test_a_tensor_no_dump_can_hold_is_refused_outside_the_chosen_steps(tmp_path):
    """Checked only inside a chosen step, a complex tensor added every step passed until step 100, long
    into the run, and there stopped it. It is refused at its first add(), whatever the steps chosen."""
    with megalign.Dumper(tmp_path / "run", steps=[100]) as dumper:
        with dumper.step(0):
            with pytest.raises(TypeError) as refused:
                dumper.add("activation", "z", torch.ones(2, dtype=torch.complex64))
    assert str(refused.value) == f"activation z: megalign stores {STORED}; got a complex64 tensor"


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


def test_the_dumpers_refusals_name_its_own_arguments(tmp_path, monkeypatch):
    """They said `--out` and `--overwrite`, which a Python caller never typed."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(UserError) as refused:
        megalign.Dumper(notes, overwrite=True)
    assert str(refused.value) == (f"Dumper out {notes} is not a megalign dump (no megalign dump.json in it); "
                                  "overwrite=True only replaces megalign dumps")
    first = megalign.Dumper(tmp_path / "out")
    with pytest.raises(UserError, match=r"is writing .*out\.partial; wait for it or choose another Dumper out$"):
        megalign.Dumper(tmp_path / "out")
    first.close()
    again = megalign.Dumper(tmp_path / "out", overwrite=True)
    monkeypatch.chdir(tmp_path / "out")  # the folder to replace now holds the working folder
    with pytest.raises(UserError) as refused:
        again.close()
    assert str(refused.value) == (f"Dumper out {tmp_path / 'out'} is the working folder or holds it; overwrite=True "
                                  "will not replace it")
    assert (notes / "todo.txt").read_text() == "keep me" and megalign.open(tmp_path / "out").names() == []


def written_steps(out, steps) -> list[int]:
    """The steps a Dumper given `steps` writes of a loop of steps 0 to 3."""
    model = torch.nn.Linear(2, 1)
    with megalign.Dumper(out, steps=steps) as dumper:
        dumper.watch(model)
        for n in range(4):
            with dumper.step(n):
                model(torch.ones(1, 2)).sum().backward()
    return megalign.open(out).meta["steps"]


def test_steps_as_one_step_none_and_a_negative_step(tmp_path):
    """steps=5 and steps=None raised torch's TypeError ('int' object is not iterable); steps=[-1] chose no step."""
    assert written_steps(tmp_path / "one", 2) == [2]  # as MEGALIGN_DUMP_STEPS=2
    assert written_steps(tmp_path / "none", None) == [0, 1, 2, 3]
    with pytest.raises(UserError, match=r"^steps: steps are whole numbers from 0, got \[-1\]$"):
        megalign.Dumper(tmp_path / "last", steps=[-1])
    with pytest.raises(UserError, match=r"^steps: expected all, a step, a list of steps, or every:K, got 1.5$"):
        megalign.Dumper(tmp_path / "half", steps=1.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["none", "one"]


def test_a_step_written_already_is_refused(tmp_path):
    """A step counter that starts again each epoch: step(1) twice put both runs' tensors under one step."""
    model = torch.nn.Linear(2, 1)
    refused = []
    with megalign.Dumper(tmp_path / "out") as dumper:
        dumper.watch(model)
        for n in (0, 1, 0):  # the second epoch's first step
            try:
                with dumper.step(n):
                    model(torch.ones(1, 2)).sum().backward()
            except RuntimeError as error:
                refused.append(str(error))
    assert refused == ["step(0) ran already: its tensors would stand beside the first run's under one step (a step "
                       "counter that starts again, each epoch?)"]
    out = megalign.open(tmp_path / "out")
    assert out.meta["steps"] == [0, 1]
    assert [name for _, name in out.names("param_grad")] == ["step0/weight", "step0/bias", "step1/weight", "step1/bias"]


def test_a_blank_megalign_dump_is_refused(tmp_path, monkeypatch):
    """MEGALIGN_DUMP=" " made a folder named " "."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGALIGN_DUMP", " ")
    with pytest.raises(UserError, match=r"^MEGALIGN_DUMP=' ' starts or ends with a blank: give the folder without "):
        megalign.Dumper.from_env()
    assert list(tmp_path.iterdir()) == []
