"""A user's loop and its steps: a step that raises is left out, dumps of other steps compare on the
steps both hold, and what would lose a dump without a word (a step number that is no number, calls
after close(), a Dumper never closed, a working folder changed before close()) is said at once.

The loop is written as a user writes it: megalign.Dumper's public API around a small torch model,
each run's dump compared with the real CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

import megalign
from megalign.errors import UserError
from tests.conftest import invoke
from tests.test_api import REPO


def loop(out: Path, steps, *, raises_at: Optional[int] = None, doubled_at: Optional[int] = None) -> None:
    """Three steps of a small model with SGD, the step counter numpy's (np.arange); `raises_at`: that
    step's first try raises an out-of-memory error, which the loop catches and tries the step again
    on; `doubled_at`: the planted bug, that step's loss doubled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with megalign.Dumper(out, steps=steps, params=True) as dumper:
        dumper.watch(model)
        for step in np.arange(3):
            for attempt in range(2):
                try:
                    with dumper.step(step):
                        loss = model(torch.linspace(-1, 1, 12).view(3, 4) * (step + 1)).square().mean()
                        if step == raises_at and attempt == 0:
                            raise torch.OutOfMemoryError("CUDA out of memory (planted)")
                        loss = loss * 2 if step == doubled_at else loss
                        dumper.add("loss", "loss", loss.detach())
                        loss.backward()
                    break
                except torch.OutOfMemoryError:
                    optimizer.zero_grad()
            optimizer.step()
            optimizer.zero_grad()


def test_a_step_that_raises_is_left_out_of_the_dump(tmp_path):
    """The loop tries step 0 again: the failed try's records stood beside the second's (`0@1`, ...),
    missing from a run that never failed: a false FAIL."""
    with pytest.warns(UserWarning, match="step 0 raised OutOfMemoryError: it is left out of the dump"):
        loop(tmp_path / "tried_again", [0, 1], raises_at=0)
    loop(tmp_path / "clean", [0, 1])
    tried = megalign.open(tmp_path / "tried_again")
    assert tried.meta["steps"] == [0, 1] and all(type(n) is int for n in tried.meta["steps"])
    assert tried.names() == megalign.open(tmp_path / "clean").names()
    result = invoke("compare", tmp_path / "clean", tmp_path / "tried_again")
    assert result.exit_code == 0, result.output
    assert "30 compared, 30 passed, 0 failed\n" in result.output
    # The failing twin: the retried run's step 1 doubled is caught at its loss.
    with pytest.warns(UserWarning, match="step 0 raised"):
        loop(tmp_path / "tried_again_bug", [0, 1], raises_at=0, doubled_at=1)
    result = invoke("compare", tmp_path / "clean", tmp_path / "tried_again_bug")
    assert result.exit_code == 1, result.output
    assert "first divergence: loss step1/loss\n" in result.output


def test_dumps_of_other_steps_compare_the_steps_both_hold(tmp_path):
    loop(tmp_path / "both", [1, 2])
    loop(tmp_path / "second", [2])
    result = invoke("compare", tmp_path / "both", tmp_path / "second")
    assert result.exit_code == 0, result.output
    assert "step 1 set aside (not in B)" in result.output
    assert "loss        step2/loss" in result.output and "step1/" not in result.output
    # The failing twin: step 2 doubled in the one-step dump, named by its step.
    loop(tmp_path / "second_bug", [2], doubled_at=2)
    result = invoke("compare", tmp_path / "both", tmp_path / "second_bug")
    assert result.exit_code == 1, result.output
    assert "first divergence: loss step2/loss\n" in result.output
    # Step 1 against step 2 is no comparison: the drift of a step would read as a divergence.
    loop(tmp_path / "first", [1])
    result = invoke("compare", tmp_path / "first", tmp_path / "second")
    assert result.exit_code == 2, result.output
    assert "error: A holds step 1, B step 2: no step in common, nothing compared" in result.output


def test_what_would_lose_a_dump_without_a_word_is_refused_at_once(tmp_path):
    model = torch.nn.Linear(2, 2)
    dumper = megalign.Dumper(tmp_path / "mine")
    dumper.watch(model)
    for number in ("1", None, 1.0, True):
        with pytest.raises(TypeError, match="step's number"), dumper.step(number):
            pass
    with pytest.raises(RuntimeError, match=r"step\(1\) inside step\(0\): steps do not nest"):
        with pytest.warns(UserWarning, match="step 0 raised RuntimeError"):  # the outer step, left out
            with dumper.step(0), dumper.step(torch.tensor(1)):
                pass
    dumper.close()
    for late in (lambda: dumper.add("loss", "loss", torch.ones(1)), lambda: dumper.watch(model)):
        with pytest.raises(RuntimeError, match="is closed: what (add|watch)"):
            late()
    assert megalign.open(tmp_path / "mine").meta["steps"] == []

    twice = megalign.Dumper(tmp_path / "twice")
    layers = torch.nn.Sequential(model, torch.nn.ReLU())
    twice.watch(layers)
    with pytest.raises(ValueError, match="watched already"):
        twice.watch(layers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # the refusal aborted it: nothing left

    with pytest.warns(UserWarning, match=r"none of the steps it was to dump ran \(steps 7\): the dump holds no"):
        with megalign.Dumper(tmp_path / "late", steps="7") as late, late.step(0):
            pass

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty; pass overwrite=True to replace it"):
        megalign.Dumper(tmp_path / "notes")


SCRIPT = """
import os, sys
import torch
import megalign

dumper = megalign.Dumper(sys.argv[1])
dumper.add("loss", "loss", torch.tensor(2.5))
if sys.argv[2] == "chdir":  # a relative out, and the working folder changed before close()
    os.makedirs("elsewhere")
    os.chdir("elsewhere")
    dumper.close()
"""


@pytest.mark.parametrize("ending", ["chdir", "never-closed"])
def test_a_relative_out_survives_a_chdir_and_a_dumper_never_closed_says_so(tmp_path, ending):
    (tmp_path / "script.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "script.py", "dumps/mine", ending], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "dumps").iterdir())
    if ending == "chdir":
        assert left == ["dumps/mine"]
        assert megalign.open(tmp_path / "dumps" / "mine").tensor("loss", "loss").item() == 2.5
    else:
        out = tmp_path / "dumps" / "mine"
        assert done.stderr == (f"megalign:0: UserWarning: megalign.Dumper({str(out)!r}) was never closed: nothing "
                               "was written (call close(), or use the Dumper in a with block)\n")
        assert left == []  # its staging folder removed



def clipped_loop(out: Path, clip_part: bool) -> None:
    """Two steps of a small model, clipped inside the Dumper's step block and stepped after it, as
    Dumper.step says; `clip_part`: the planted bug, the norm taken over the last layer only (as a
    rank's own shard's would be), and only its gradients clipped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with megalign.Dumper(out, params=True) as dumper:
        dumper.watch(model)
        for step in range(2):
            with dumper.step(step):
                loss = model(torch.linspace(-1, 1, 12).view(3, 4) * (step + 1)).square().mean()
                dumper.add("loss", "loss", loss.detach())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(model.parameters())[2:] if clip_part else model.parameters(),
                                               0.01)
            optimizer.step()
            optimizer.zero_grad()


def test_the_first_divergence_follows_the_computation_a_clip_bug_at_its_gradients(tmp_path):
    """Each step's rows in the order of the computation: the parameters its forward uses, the forward,
    the loss, the activation gradients, the parameter gradients. The clip bug is first seen at step 0's
    gradients; step 1's parameters, made from them, are the first of step 1."""
    clipped_loop(tmp_path / "a", clip_part=False)
    clipped_loop(tmp_path / "twin", clip_part=False)
    assert invoke("compare", tmp_path / "a", tmp_path / "twin").exit_code == 0
    clipped_loop(tmp_path / "b", clip_part=True)
    result = invoke("compare", tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 1, result.output
    assert "first divergence: param_grad step0/0.weight#stepped\n" in result.output
    assert "first failure per kind: param_grad step0/0.weight#stepped; param step1/0.bias;" in result.output
    rows = [line.split()[:3] for line in result.output.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    for step in ("step0/", "step1/"):
        kinds = [kind for _, kind, name in rows if name.startswith(step)]
        assert kinds == sorted(kinds, key=["param", "act", "loss", "act_grad", "param_grad"].index), kinds
