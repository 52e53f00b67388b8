"""A user's GPT-2 loop (gpt2_train.py: a model family megalign maps nothing of, its learned position
embedding's output shared by every row) under torch DDP and FSDP2 at their defaults, which average
the gradients: with the loss each rank's token-loss sum over the whole batch's count times the world
size, world 2 agrees with one process as written. The Dumper records each run's reduction
(dump.json's grad_reduction), and compare divides the activation gradients by it; the position
embedding's output gradient is each rank's partial sum over its rows. The parameter gradients are
read at the reduction and again as the optimizer steps on them (`#stepped`, where a clip changed
them), so that a clip inside the step block and one after it agree, and a clip bug fails at its own
step wherever it stands. Each planted bug fails where it starts; where its cause is one rank's (its
data shard, its dropout masks), the rank is named under the first divergence. Every compare reads
whole in a terminal 80 columns wide.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import megalign
from tests.conftest import assert_whole, at_80_columns, invoke
from tests.trainer.torchruns import dump_all

SCRIPT = Path(__file__).with_name("gpt2_train.py")
DDP, FSDP2 = ("--wrap", "ddp"), ("--wrap", "fsdp2")
INSIDE = ("--clip", "inside")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    return dump_all(tmp_path_factory.mktemp("gpt2"), SCRIPT, {
        "ddp1": (1, DDP), "ddp2": (2, DDP), "fsdp1": (1, FSDP2), "fsdp2": (2, FSDP2),
        "rank_mean": (2, (*DDP, "--bug", "rank-mean")), "unscaled": (2, (*FSDP2, "--bug", "unscaled")),
        "same_shard": (2, (*DDP, "--bug", "same-shard")),
        "dropout1": (1, (*DDP, "--bug", "dropout")), "dropout": (2, (*DDP, "--bug", "dropout")),
        "fsdp2_inside": (2, (*FSDP2, *INSIDE)), "local_clip": (2, (*FSDP2, "--bug", "local-clip")),
        "local_clip_inside": (2, (*FSDP2, *INSIDE, "--bug", "local-clip"))})


@pytest.mark.parametrize("one, two, by", [("ddp1", "ddp2", "torch DDP"), ("fsdp1", "fsdp2", "FSDP2")])
def test_averaged_gradients_at_world_2_equal_one_process(dumps, one, two, by):
    assert json.loads((dumps[two] / "dump.json").read_text())["grad_reduction"] == {
        "divide_by": 2.0, "by": f"{by}, mean of 2 ranks"}
    result = invoke("compare", dumps[one], dumps[two])
    assert result.exit_code == 0, result.output
    assert f"grads summed ({by}, one rank)" in result.output
    assert f"grads /2 ({by}, mean of 2 ranks): act grads /2" in result.output
    assert re.search(r"act_grad +step2/transformer.wpe +1x8x32 .* PASS", result.output)
    # 28 parameters' gradients a step, as reduced and as the optimizer stepped on them (clipped)
    assert re.search(r"param_grad +step0/transformer.wte.weight#stepped +67x32 .* PASS", result.output)
    assert "429 compared, 429 passed, 0 failed\n" in result.output


def test_a_shared_outputs_gradient_is_a_partial_sum_and_the_loss_a_partial_mean(dumps):
    """GPT-2's position embedding output [1, s, d]: a replica forward, each rank's sum over its rows backward."""
    two = megalign.open(dumps["ddp2"])
    assert [s.sharding.dp_dim for s in two.shards("activation", "step0/transformer.wpe")] == [None, None]
    assert [s.sharding.mesh.placements for s in two.shards("activation_grad", "step0/transformer.wpe")] == \
        [("R", "P", "P", "R")] * 2
    one = megalign.open(dumps["ddp1"])
    assert two.tensor("loss", "step1/loss").item() == pytest.approx(one.tensor("loss", "step1/loss").item(), rel=1e-6)


@pytest.mark.parametrize("bug, one, first, rank", [
    ("rank_mean", "ddp1", "loss step0/loss", None),  # each rank's own mean over its uneven mask
    ("unscaled", "fsdp1", "loss step0/loss", None),  # averaged, but the loss not times the world size
    # both ranks on the first rank's rows: with uneven masks, another count of real tokens
    ("same_shard", "ddp1", "activation step0/transformer.wte",
     "B's DP rank 1 holds the rows of its DP rank 0 (data sharding?)"),
    # dropout on at both worlds: rank 1 draws the masks rank 0 draws, not those of the batch's next rows
    ("dropout", "dropout1", "activation step0/transformer.drop",
     "only B's DP rank 1 rows differ (random state, data sharding?)"),
    # the local shard's norm, clipping inside the step block or after it, against a clip after it
    ("local_clip_inside", "fsdp1", "param_grad step0/transformer.wte.weight#stepped", None),
    ("local_clip", "fsdp1", "param_grad step0/transformer.wte.weight#stepped", None),
])
def test_each_planted_bug_fails_where_it_starts(dumps, bug, one, first, rank):
    """And where the difference is one rank's own (its data, its random state), the rank is named
    under the first divergence; the other bugs are every rank's, and no rank is named."""
    result = invoke("compare", dumps[one], dumps[bug])
    assert result.exit_code == 1, result.output
    said = f"  {rank}\n" if rank else ""
    assert f"first divergence: {first}\n{said}first failure per kind" in result.output


def test_a_clip_inside_the_step_block_agrees_with_one_clipping_after_it(dumps):
    """The twin of the local clips: clip_grad_norm_ over FSDP2's DTensors inside step(), against one
    process clipping after it. Before the reduced gradients were read apart, the clip inside read as
    every param_grad scaled."""
    result = invoke("compare", dumps["fsdp1"], dumps["fsdp2_inside"])
    assert result.exit_code == 0, result.output


def test_a_clip_after_the_step_block_shows_at_its_own_step(dumps):
    """Before: the local clip after step() passed step 0 and showed at param step1/. Now the reduced
    gradients agree and the ones the optimizer steps on fail."""
    result = invoke("compare", dumps["fsdp1"], dumps["local_clip"])
    assert re.search(r"param_grad +step0/transformer.wte.weight +67x32 .* PASS", result.output), result.output
    assert re.search(r"param_grad +step0/transformer.wte.weight#stepped +67x32 .* FAIL", result.output)


@pytest.mark.parametrize("one, two", [("ddp1", "ddp2"), ("fsdp1", "fsdp2"), ("ddp1", "rank_mean"), ("fsdp1", "unscaled"),
                                      ("ddp1", "same_shard"), ("dropout1", "dropout"), ("fsdp1", "local_clip_inside"),
                                      ("fsdp1", "local_clip")])
def test_each_compare_reads_whole_at_80_columns(dumps, one, two, tmp_path):
    """Before, the sides' lines (their gradient conventions) and the summary's were one line each,
    which a terminal cuts anywhere; the same-shard twin's SHAPE_MISMATCH status left the table one
    column too wide, and it came out as plain text, every row past the edge."""
    assert_whole(*at_80_columns(dumps[one], dumps[two], tmp_path / "report.jsonl"))


def test_a_report_cut_or_left_unwrapped_is_caught(dumps, tmp_path):
    """The failing twin of the 80-column check: the same-shard report with its first side's line
    unwrapped, and with its last summary line cut in half."""
    output, records = at_80_columns(dumps["ddp1"], dumps["same_shard"], tmp_path / "report.jsonl")
    lines = output.splitlines()
    for planted in (" ".join(lines[:2]), *lines[2:]), (*lines[:-1], lines[-1][:len(lines[-1]) // 2]):
        with pytest.raises(AssertionError):
            assert_whole("\n".join(planted), records)

