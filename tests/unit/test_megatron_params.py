"""The TP split of megatron-core's parameters told by their names (dump/megatron_params.py), checked
against the split megatron itself marks on them (partition_dim, as a real TP=2 dump records it)."""

from __future__ import annotations

import json

import pytest

from megalign.dump.megatron_params import UnknownParameter, gated_linear, tp_dim_by_name

TP2 = ("backward", "--tp", "2")


def test_names_say_what_megatron_marks(dump):
    manifest = json.loads((dump(*TP2) / "rank-00000" / "manifest.json").read_text())
    grads = [r for r in manifest["tensors"] if r["kind"] == "param_grad"]
    assert len(grads) == 15
    for record in grads:
        assert tp_dim_by_name(record["name"]) == record["sharding"]["tp_dim"], record["name"]
        assert gated_linear(record["name"]) == (record["sharding"]["tp_parts"] == 2), record["name"]


def test_biases_and_unknown_names():
    assert tp_dim_by_name("decoder.layers.0.self_attention.linear_qkv.bias") == 0
    assert tp_dim_by_name("decoder.layers.0.mlp.linear_fc2.bias") is None
    assert tp_dim_by_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") is None
    with pytest.raises(UnknownParameter):
        tp_dim_by_name("decoder.layers.0.self_attention.linear_q_down_proj.weight")
