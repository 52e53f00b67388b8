"""A user's Hugging Face training loop under FSDP2 (hf_fsdp2_train.py: a tiny LlamaForCausalLM,
fully_shard on each decoder layer and the root, AdamW, two steps) dumped with
`megalign.Dumper.from_env()` under torchrun on gloo: world 2 agrees with the same script as one
process, parameter gradients (DTensors, the 67-row embedding split 34 + 33) and activations (named
by their HF modules) alike; the loss as each rank's mean over its uneven loss mask is caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import megalign
from tests.conftest import invoke
from tests.trainer.torchruns import dump_all

SCRIPT = Path(__file__).with_name("hf_fsdp2_train.py")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """World 1, world 2, and world 2 with the bug, side by side."""
    return dump_all(tmp_path_factory.mktemp("hf_fsdp2"), SCRIPT,
                    {"w1": (1, ()), "w2": (2, ()), "w2_bug": (2, ("--bug", "rank-mean"))})


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
