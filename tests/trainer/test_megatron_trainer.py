"""A user's megatron-core training loop (megatron_train.py: its own GPTModel, DDP with the
distributed optimizer, Adam, its own loss, three steps) dumped with `megalign.Dumper.from_env()`
under torchrun on gloo, compared with the CLI: CP=2 agrees with CP=1 at every dumped step, and the
classic CP bug (each rank's loss divided by its own token count) is caught at its first tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import megalign
from tests.conftest import invoke
from tests.trainer.torchruns import finish, start

SCRIPT = Path(__file__).with_name("megatron_train.py")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """The script's own steps (1 and 2) at CP=1 and CP=2; steps 0 and 1 (MEGALIGN_DUMP_STEPS) at CP=1
    and at CP=2 with the bug. Two torchruns at a time."""
    root = tmp_path_factory.mktemp("trainer")
    made = {name: root / name for name in ("cp1", "cp2", "cp1_early", "cp2_bug")}
    finish(start(made["cp1"], "--cp", "1", script=SCRIPT), start(made["cp2"], "--cp", "2", script=SCRIPT))
    finish(start(made["cp1_early"], "--cp", "1", steps="0,1", script=SCRIPT),
           start(made["cp2_bug"], "--cp", "2", "--bug", "local-tokens", steps="0,1", script=SCRIPT))
    return made


def test_cp2_equals_cp1_at_every_dumped_step(dumps):
    cp2 = megalign.open(dumps["cp2"])
    assert cp2.meta["steps"] == [1, 2] and cp2.meta["layout"]["cp"] == 2
    result = invoke("compare", dumps["cp1"], dumps["cp2"])
    assert result.exit_code == 0, result.output
    for step in (1, 2):  # every step both dumps hold, its parameters and their gradients included
        assert f"param       step{step}/output_layer.weight" in result.output
        assert f"param_grad  step{step}/output_layer.weight" in result.output
        assert f"loss        step{step}/loss" in result.output
    assert "116 compared, 116 passed, 0 failed\n" in result.output


def test_a_loss_divided_by_the_ranks_own_token_count_is_caught_at_the_loss(dumps):
    assert megalign.open(dumps["cp2_bug"]).meta["steps"] == [0, 1]
    result = invoke("compare", dumps["cp1_early"], dumps["cp2_bug"])
    assert result.exit_code == 1, result.output
    assert "first divergence: loss step0/loss\n" in result.output
