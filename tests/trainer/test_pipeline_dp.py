"""A user's hand-written pipeline (pipeline_train.py: two stages of two data-parallel ranks each, send
and recv between them, torch DDP over each stage's own DP group, SGD, two steps) dumped under
torchrun on gloo with `megalign.Dumper.from_env(dp_group=...)`: world 4 agrees with one process,
each stage's names reassembled from its own DP ranks only; the batch's row count all-reduced over
the whole world is caught at the loss; a Dumper not told DDP's group is refused before anything is
written (placed over the world, one stage's replicas would be checked against the other's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import megalign
from tests.conftest import invoke
from tests.trainer.torchruns import dump_all, refused

SCRIPT = Path(__file__).with_name("pipeline_train.py")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    return dump_all(tmp_path_factory.mktemp("pipeline"), SCRIPT,
                    {"one": (1, ()), "pp2dp2": (4, ()), "pp2dp2_bug": (4, ("--bug", "world-count"))})


def test_two_stages_of_two_dp_ranks_equal_one_process(dumps):
    pp2dp2 = megalign.open(dumps["pp2dp2"])
    assert (pp2dp2.meta["layout"]["pp"], pp2dp2.meta["layout"]["dp"]) == (2, 2)
    # A stage's names on its own DP ranks only: blocks.0 on ranks 0 and 1, split on the batch.
    assert [(s.rank, s.dp_rank, s.sharding.dp_dim) for s in pp2dp2.shards("activation", "step0/blocks.0")] == [
        (0, 0, 0), (1, 1, 0)]
    assert [s.rank for s in pp2dp2.shards("param_grad", "step1/head.weight")] == [2, 3]
    result = invoke("compare", dumps["one"], dumps["pp2dp2"])
    assert result.exit_code == 0, result.output
    assert "act_grad    step0/blocks.1 " in result.output and "param       step1/blocks.3.up.weight" in result.output
    assert "186 compared, 186 passed, 0 failed\n" in result.output


def test_the_row_count_summed_over_the_world_is_caught_at_the_loss(dumps):
    result = invoke("compare", dumps["one"], dumps["pp2dp2_bug"])
    assert result.exit_code == 1, result.output
    assert "first divergence: loss step0/loss\n" in result.output
    assert "norm ratio B/A 0.5" in result.output  # every gradient halved


def test_a_dumper_not_told_ddps_group_is_refused_before_any_dump(tmp_path):
    output = refused(tmp_path / "nogroup", "--no-dp-group", script=SCRIPT, ranks=4)
    assert ("UserError: DDP averages gradients over ranks [2, 3], the Dumper's data-parallel group is ranks "
            "[0, 1, 2, 3]: pass megalign.Dumper(..., dp_group=) the process_group given to DDP") in output
