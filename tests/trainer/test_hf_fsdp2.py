"""A user's Hugging Face training loop under FSDP2 (hf_fsdp2_train.py: a tiny LlamaForCausalLM,
fully_shard on each decoder layer and the root, AdamW, two steps) dumped with
`megalign.Dumper.from_env()` under torchrun on gloo: world 2 agrees with the same script as one
process, parameter gradients (DTensors, the 67-row embedding split 34 + 33) and activations (named
by their HF modules) alike; the loss as each rank's mean over its uneven loss mask is caught.
Right-padded rows (an attention mask, passed by position, other rows each step) are lined up token by
token between runs padded to other lengths, as `watch(model, batch_dim=0, seq_dim=1)` records them
step by step; pad tokens left in the loss are caught.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import megalign
from tests.conftest import invoke
from tests.trainer.torchruns import dump_all

SCRIPT = Path(__file__).with_name("hf_fsdp2_train.py")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """World 1, world 2, world 2 with the bug; padded rows: world 1 to 16 tokens, world 2 to 12, and
    with the pad tokens' labels kept; side by side."""
    return dump_all(tmp_path_factory.mktemp("hf_fsdp2"), SCRIPT,
                    {"w1": (1, ()), "w2": (2, ()), "w2_bug": (2, ("--bug", "rank-mean")),
                     "w1_pad16": (1, ("--pad", "16")), "w2_pad12": (2, ("--pad", "12")),
                     "w2_pad12_bug": (2, ("--pad", "12", "--bug", "pad-labels"))})


def test_fsdp2_at_world_2_equals_one_process(dumps):
    result = invoke("compare", dumps["w1"], dumps["w2"])
    assert result.exit_code == 0, result.output
    for step in (0, 1):
        assert f"param_grad  step{step}/model.embed_tokens.weight" in result.output
        assert f"param       step{step}/lm_head.weight" in result.output
        assert f"act         step{step}/model.layers.1.mlp.down_proj" in result.output
        assert f"act_grad    step{step}/model.layers.0.self_attn.q_proj" in result.output
    assert "214 compared, 214 passed, 0 failed\n" in result.output


def test_dtensor_gradients_are_dumped_as_their_uneven_pieces(dumps):
    w2 = megalign.open(dumps["w2"])
    shards = w2.shards("param_grad", "step0/model.embed_tokens.weight")
    assert [(s.shape, s.sharding.mesh.offset, s.sharding.mesh.placements) for s in shards] == [
        ([34, 32], (0, 0), ("S0",)), ([33, 32], (34, 0), ("S0",))]
    assert w2.tensor("param_grad", "step0/model.embed_tokens.weight").shape == (67, 32)
    # The rotary tables are the same on every rank: replicas, not the batch split.
    assert [s.sharding.dp_dim for s in w2.shards("activation", "step0/model.rotary_emb")] == [None, None]
    assert [s.sharding.dp_dim for s in w2.shards("activation", "step0/model.embed_tokens")] == [0, 0]


def test_a_per_rank_mean_over_uneven_loss_masks_is_caught_at_the_loss(dumps):
    result = invoke("compare", dumps["w1"], dumps["w2_bug"])
    assert result.exit_code == 1, result.output
    assert "first divergence: loss step0/loss\n" in result.output
    assert "param_grad step0/model.embed_tokens.weight" in result.output  # the gradients follow it


def test_rows_padded_to_other_lengths_are_lined_up_token_by_token(dumps):
    """23 real tokens in step 0 (rows of 8, 5, 7 and 3) and 20 in step 1 (4, 8, 6, 2) padded to 16 in one
    process and to 12 on each of two ranks: activations and their gradients at the real tokens,
    parameter gradients and the steps' parameters all agree; the RoPE tables and the attention weights
    cannot be lined up. The mask is passed by position (`model(ids, mask, ...)`): read as absent, every
    pad token would count as real, and the token tensors' shapes would differ."""
    steps = megalign.open(dumps["w2_pad12"]).meta["step_rows"]
    assert [[row["lengths"] for row in step["rows"]] for step in steps] == [[[8], [5], [7], [3]], [[4], [8], [6], [2]]]
    result = invoke("compare", dumps["w1_pad16"], dumps["w2_pad12"])
    assert result.exit_code == 0, result.output
    assert re.search(r"act +step1/model.layers.1.mlp.down_proj +20x32 .* PASS", result.output)
    assert re.search(r"act_grad +step0/model.embed_tokens +23x32 .* PASS", result.output)
    assert "202 compared, 202 passed, 0 failed, 12 not lined up" in result.output
    assert "APART   a batch dim and the rows' length on a dim not recorded as the sequence dim" in result.output


def test_pad_tokens_left_in_the_loss_are_caught_at_the_loss(dumps):
    """Twin: the padding's labels kept: the loss counts the pad tokens too, as many as each run padded."""
    result = invoke("compare", dumps["w1_pad16"], dumps["w2_pad12_bug"])
    assert result.exit_code == 1, result.output
    assert "first divergence: loss step0/loss\n" in result.output
