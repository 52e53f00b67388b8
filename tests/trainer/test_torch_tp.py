"""A user's loop under torch's tensor parallelism (tp_train.py: GPT-2's MLP column- then row-parallel
at the styles' defaults on a 1-D mesh, plain layers around it, the clip written out for a mix of
DTensor and plain gradients, AdamW, three steps) dumped under torchrun on gloo: the dump is labelled
TP, the parallelized modules' outputs are read as the DTensors their forward returns (a Shard(-1)
and a Partial(sum) one, their gradients too), and world 2 agrees with one process; clipping by the
norm of the local shards only fails at step 0's parameter gradients.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import megalign
from tests.conftest import assert_whole, at_80_columns, invoke
from tests.trainer.torchruns import dump_all

SCRIPT = Path(__file__).with_name("tp_train.py")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    return dump_all(tmp_path_factory.mktemp("torch_tp"), SCRIPT,
                    {"tp1": (1, ()), "tp2": (2, ()), "tp2_bug": (2, ("--bug", "local-norm"))})


def test_the_run_is_labelled_tp(dumps):
    assert json.loads((dumps["tp2"] / "dump.json").read_text())["layout"]["tp"] == 2
    assert [(s.tp_rank, s.dp_rank) for s in
            megalign.open(dumps["tp2"]).shards("loss", "step0/loss")] == [(0, 0), (1, 0)]


def test_parallelized_outputs_and_parameters_are_placed_by_their_dtensors(dumps):
    tp2 = megalign.open(dumps["tp2"])

    def placements(kind, name):
        return [s.sharding.mesh and s.sharding.mesh.placements for s in tp2.shards(kind, f"step0/{name}")]

    assert placements("activation", "mlp.c_fc") == [("S2",)] * 2  # ColwiseParallel: Shard(-1)
    assert placements("activation", "mlp.c_proj") == [("P",)] * 2  # RowwiseParallel, before its all-reduce
    assert placements("activation_grad", "mlp.c_proj") == [("R",)] * 2
    assert placements("param_grad", "mlp.c_fc.weight") == [("S0",)] * 2
    assert placements("param_grad", "mlp.c_proj.weight") == [("S1",)] * 2
    assert placements("param_grad", "mlp.c_proj.bias") == [("R",)] * 2
    assert placements("param_grad", "norm.weight") == [None] * 2  # a plain replica
    # The other modules' plain outputs carry no placement: left out, in one process as at TP=2.
    assert {name for _, name in tp2.names("activation")} == {f"step{n}/mlp.{m}" for n in range(3)
                                                             for m in ("c_fc", "c_proj")}


def test_tp2_equals_one_process(dumps):
    result = invoke("compare", dumps["tp1"], dumps["tp2"])
    assert result.exit_code == 0, result.output
    assert "B " in result.output and "tp=2 pp=1 cp=1, fp32" in result.output
    assert "105 compared, 105 passed, 0 failed\n" in result.output  # 30 gradients also as the optimizer took them (#stepped)


def test_clipping_by_the_local_norm_is_caught_at_its_own_steps_gradients(dumps):
    result = invoke("compare", dumps["tp1"], dumps["tp2_bug"])
    assert result.exit_code == 1, result.output
    assert "first divergence: param_grad step0/embed.weight#stepped\n" in result.output


@pytest.mark.parametrize("two", ["tp2", "tp2_bug"])
def test_each_compare_reads_whole_at_80_columns(dumps, two, tmp_path):
    assert_whole(*at_80_columns(dumps["tp1"], dumps[two], tmp_path / "report.jsonl"))

