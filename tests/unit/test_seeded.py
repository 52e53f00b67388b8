"""Seeded weights (megalign/stacks/seeded.py) on synthetic shapes: a shard drawn directly is the same
slice of the full tensor drawn whole, for every TP split megatron makes (dim 0, the last dim, fused
gate|up parts, a 3-D tensor), with chunks that do not divide the tensor or the shards."""

from __future__ import annotations

import pytest
import torch

from megalign.dump.sharding import Sharding, merge_tp
from megalign.stacks.seeded import seeded_weights
from megalign.stacks.shard import ParamShard

CHUNK = 7  # divides none of the shapes below, nor any shard's rows
CASES = [  # (name, full shape, sharding)
    ("decoder.layers.0.self_attention.linear_qkv.weight", (24, 10), Sharding(tp_dim=0)),
    ("decoder.layers.0.self_attention.linear_proj.weight", (10, 12), Sharding(tp_dim=1)),
    ("decoder.layers.0.mlp.linear_fc1.weight", (16, 10), Sharding(tp_dim=0, tp_parts=2)),
    ("decoder.layers.0.mlp.linear_fc1.bias", (16,), Sharding(tp_dim=0, tp_parts=2)),
    ("decoder.layers.1.mlp.experts.3.linear_fc2.weight", (3, 8, 5), Sharding(tp_dim=1)),
]


def draw(name: str, shape, sharding=Sharding(), tp_rank=0, tp_size=1, chunk=CHUNK, seed=1234):
    return seeded_weights(seed, 0.02, chunk=chunk)(name, ParamShard(tuple(shape), sharding, tp_rank, tp_size))


@pytest.mark.parametrize("name,shape,sharding", CASES, ids=[c[0].rsplit(".", 2)[-2] + str(c[1]) for c in CASES])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_a_shard_drawn_directly_is_the_slice_of_the_full_tensor(name, shape, sharding, tp_size):
    full = draw(name, shape)
    shards = [draw(name, shape, sharding, rank, tp_size) for rank in range(tp_size)]
    for rank, drawn in enumerate(shards):
        assert torch.equal(drawn, ParamShard(shape, sharding, rank, tp_size).of(full))
    assert torch.equal(merge_tp(shards, sharding.tp_dim, sharding.tp_parts), full)


def test_the_numbers_depend_on_seed_name_and_chunk_but_not_on_threads(monkeypatch):
    name, shape = CASES[0][:2]
    full = draw(name, shape)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")  # one thread
    assert torch.equal(draw(name, shape), full)
    assert not torch.equal(draw(name, shape, seed=1235), full)
    assert not torch.equal(draw(CASES[2][0], (24, 10)), full)
    chunks = full.flatten().split(CHUNK)
    assert not any(torch.equal(chunks[0], other) for other in chunks[1:-1])


def test_norm_scales_are_drawn_around_one():
    scale = draw("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", (4096,), chunk=1 << 20)
    assert abs(scale.mean().item() - 1.0) < 3e-3 and abs(scale.std().item() - 0.02) < 2e-3
    matrix = draw("output_layer.weight", (64, 64))
    assert abs(matrix.mean().item()) < 3e-3
