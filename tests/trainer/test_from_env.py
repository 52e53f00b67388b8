"""`megalign.Dumper.from_env()`, the one line in a user's trainer: MEGALIGN_DUMP unset writes nothing
and installs no hooks (counted against a baseline); set, it dumps the steps MEGALIGN_DUMP_STEPS picks,
each named by its step in compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megalign
from megalign.capture.steps import StepChoice, choose_steps
from megalign.errors import UserError
from tests.conftest import invoke

REPO = Path(megalign.__file__).parent.parent

# A user's loop with the one line; it prints its hook census: before watch(), inside a step after
# backward (hooks on modules, global hooks, parameter and output-tensor hooks), and after close().
SCRIPT = """
import json, sys
import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
import megalign

def census(model, outputs=()):
    per_module = sum(len(hooks) for m in model.modules() for hooks in (
        m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks))
    global_ = sum(len(hooks) for hooks in (
        module_hooks._global_forward_hooks, module_hooks._global_forward_pre_hooks,
        module_hooks._global_backward_hooks, module_hooks._global_backward_pre_hooks,
        optimizer_hooks._global_optimizer_pre_hooks, optimizer_hooks._global_optimizer_post_hooks))
    tensors = sum(len(t._backward_hooks or {}) for t in [*model.parameters(), *outputs])
    return [per_module, global_, tensors]

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(6, 8)
before = census(model)
dumper = megalign.Dumper.from_env(params=True)
dumper.watch(model)
dumper.add("input", "x", x)  # outside any step: written only when every step is
during = []
for step in range(3):
    with dumper.step(step):
        hidden = model[0](x)
        loss = model[2](model[1](hidden)).square().mean()
        dumper.add("loss", "loss", loss)
        loss.backward()
        during.append(census(model, [hidden]))
    optimizer.step()
    optimizer.zero_grad()
dumper.close()
print(json.dumps({"dumper": type(dumper).__name__, "before": before, "during": during, "after": census(model)}))
"""


def run(tmp_path: Path, **env: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    environ = {key: value for key, value in os.environ.items() if not key.startswith("MEGALIGN_DUMP")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**environ, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_off_writes_nothing_and_installs_no_hooks(tmp_path):
    census = run(tmp_path)
    assert census["dumper"] == "NullDumper"
    assert census["during"] == [census["before"]] * 3 == [[0, 0, 0]] * 3 and census["after"] == census["before"]
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_on_dumps_the_chosen_steps_named_by_step(tmp_path):
    census = run(tmp_path, MEGALIGN_DUMP="dumps/mine", MEGALIGN_DUMP_STEPS="every:2")
    assert census["dumper"] == "Dumper"
    # The census sees the Dumper's hooks (so "off" above is a real zero): one per submodule, one on the
    # root for the end of backward and torch.optim's global step pre-hook (grad_reads.py), and on the
    # watched output; on a step it skips, the output hook installs nothing. All gone after close().
    assert census["during"] == [[4, 1, 1], [4, 1, 0], [4, 1, 1]] and census["after"] == census["before"]
    out = tmp_path / "dumps" / "mine"
    mine = megalign.open(out)
    assert mine.meta["steps"] == [0, 2]
    names = mine.names()
    assert ("input", "x") not in names  # outside a chosen step
    assert {("param", "step0/0.weight"), ("param_grad", "step2/2.bias"), ("loss", "step2/loss")} <= set(names)
    assert not any(name.startswith("step1/") for _, name in names)
    result = invoke("compare", out, out)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("text, chosen, skipped", [
    ("all", [0, 1, 7], []), ("1,2", [1, 2], [0, 3]), ([1, 2], [1, 2], [0, 3]), ("every:3", [0, 3, 6], [1, 2, 4]),
])
def test_step_choices(text, chosen, skipped):
    choice = choose_steps(text)
    assert all(choice.wants(n) for n in chosen) and not any(choice.wants(n) for n in skipped)
    assert choice.all == (text == "all") and choose_steps(choice) is choice
    assert choose_steps(str(choice)) == choice  # said as MEGALIGN_DUMP_STEPS would say it


@pytest.mark.parametrize("text", ["", "every:0", "every:x", "1,,2", "first", "²", "every:²", [1.5]])
def test_a_bad_step_choice_is_a_user_error(text):
    with pytest.raises(UserError, match="MEGALIGN_DUMP_STEPS"):
        choose_steps(text, "MEGALIGN_DUMP_STEPS")
    assert StepChoice().all


def dump_once(tmp_path: Path, monkeypatch, value: float, **env: str) -> Path:
    """One from_env() dump of a tensor into tmp_path/dump, with `env` set."""
    monkeypatch.setenv("MEGALIGN_DUMP", str(tmp_path / "dump"))
    for key, text in env.items():
        monkeypatch.setenv(key, text)
    with megalign.Dumper.from_env() as dumper:
        dumper.add("loss", "loss", torch.tensor(value))
    return tmp_path / "dump"


def test_megalign_overwrite_replaces_a_dump_and_without_it_the_dump_is_kept(tmp_path, monkeypatch):
    out = dump_once(tmp_path, monkeypatch, 1.0)
    with pytest.raises(UserError, match="overwrite"):
        dump_once(tmp_path, monkeypatch, 2.0)
    assert megalign.open(out).tensor("loss", "loss").item() == 1.0
    dump_once(tmp_path, monkeypatch, 3.0, MEGALIGN_OVERWRITE="1")
    assert megalign.open(out).tensor("loss", "loss").item() == 3.0


@pytest.mark.parametrize("variable, text", [("MEGALIGN_OVERWRITE", "yes"), ("MEGALIGN_OVERWRITE", "True"),
                                            ("MEGALIGN_STATS_ONLY", "2"), ("MEGALIGN_PARAMS", "on"),
                                            ("MEGALIGN_FILTER", "layers.("), ("MEGALIGN_DTYPE", "bf17"),
                                            ("MEGALIGN_GRAD_REDUCTION", "average"), ("MEGALIGN_DUMP_ONLY", "3:(")])
def test_a_bad_keyword_variable_is_a_one_line_user_error_before_any_dump(tmp_path, monkeypatch, variable, text):
    with pytest.raises(UserError, match=f"^{variable}: ") as error:
        dump_once(tmp_path, monkeypatch, 1.0, **{variable: text})
    assert "\n" not in str(error.value)
    assert not (tmp_path / "dump").exists()


def test_keyword_variables_set_their_keywords(tmp_path, monkeypatch):
    out = dump_once(tmp_path, monkeypatch, 1.0, MEGALIGN_STATS_ONLY="true", MEGALIGN_DTYPE="bf16",
                    MEGALIGN_FILTER="^loss$", MEGALIGN_GRAD_REDUCTION="sum")
    meta = megalign.open(out).meta
    assert (meta["stats_only"], meta["dtype"], meta["grad_reduction"]["by"]) == (True, "bf16", "stated: sum")
