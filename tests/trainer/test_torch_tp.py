"""A user's loop under torch's tensor parallelism (tp_train.py: column-, sequence- and row-parallel
layers, SGD with gradient clipping, two steps) dumped under torchrun on gloo: its parameters and
gradients are DTensors of every placement (Shard(0), Shard(1), Replicate, and Partial(sum) gradients
that compare sums), and world 2 agrees with one process; clipping by a norm of the local gradients
only is caught at its own step, in the gradients the optimizer steps on.
"""

from __future__ import annotations

import re

from pathlib import Path

import pytest

import megalign
from tests.conftest import invoke
from tests.trainer.torchruns import dump_all, refused

SCRIPT = Path(__file__).with_name("tp_train.py")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    return dump_all(tmp_path_factory.mktemp("torch_tp"), SCRIPT,
                    {"tp1": (1, ()), "tp2": (2, ()), "tp2_bug": (2, ("--bug", "local-norm"))})


def test_every_placement_is_recorded_from_the_dtensor(dumps):
    tp2 = megalign.open(dumps["tp2"])
    placements = {name: [s.sharding.mesh.placements for s in tp2.shards("param_grad", f"step0/{name}")]
                  for name in ("0.weight", "1.weight", "2.weight", "2.bias")}
    assert placements == {"0.weight": [("S0",)] * 2, "1.weight": [("P",)] * 2, "2.weight": [("S1",)] * 2,
                          "2.bias": [("R",)] * 2}


def test_tp2_equals_one_process(dumps):
    result = invoke("compare", dumps["tp1"], dumps["tp2"])
    assert result.exit_code == 0, result.output
    # the parameters' gradients as reduced, and as clipped before the optimizer stepped (#stepped)
    assert "38 compared, 38 passed, 0 failed\n" in result.output


def test_clipping_by_the_local_norm_is_caught_at_its_own_step(dumps):
    """The clip stands after the step block: the gradients the optimizer steps on are read at its
    step (before, the bug showed at step 1's parameters)."""
    result = invoke("compare", dumps["tp1"], dumps["tp2_bug"])
    assert result.exit_code == 1, result.output
    assert re.search(r"first divergence: param_grad step0/\S+#stepped\n", result.output), result.output


def test_watching_the_outputs_of_a_tensor_parallel_model_is_refused_before_any_dump(tmp_path):
    """parallelize_module's outputs are plain local pieces: put back together as replicas or as the batch
    split they would read as a divergence, so watch() refuses them, naming the way that works."""
    output = refused(tmp_path / "outputs", "--watch-outputs", script=SCRIPT, ranks=2)
    assert ("NotImplementedError: watch() of a model under torch's tensor parallelism (parallelize_module): its "
            "outputs carry no placement; watch(model, outputs=False) dumps its parameters") in output
