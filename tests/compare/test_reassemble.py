"""Reassembly of real TP=2 and CP=2 dumps against the CP=1/TP=1 dump of the same model and seed;
each check has a twin showing that the naive merge would be caught."""

from __future__ import annotations

import torch
from compare_fixtures import CP1, CP2, TP2

from megalign.compare.sources import open_source
from megalign.dump.reader import DumpFiles
from megalign.dump.sharding import merge_tp


def entries(path):
    return {(e.kind, e.name): e for e in open_source(path).entries}


def shards(path, kind, name):
    dump = DumpFiles.open(path)
    found = [(rank, r) for rank in dump.ranks for r in rank.records if (r.kind, r.name) == (kind, name)]
    return [dump.load(rank, r) for rank, r in sorted(found, key=lambda s: s[0].coords.tp_rank)], found[0][1]


def test_tp_sharded_parameter_gradients_reassemble(dump):
    full, tp = entries(dump(*CP1)), entries(dump(*TP2))
    sharded = [key for key, e in tp.items() if key[0] == "param_grad"
               and any(r.sharding.tp_dim is not None for _, r in _records(dump(*TP2), *key))]
    assert {"decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.self_attention.linear_proj.weight",
            "embedding.word_embeddings.weight", "output_layer.weight"} <= {name for _, name in sharded}
    for key in sharded:
        merged = tp[key].load().tensor
        assert merged.shape == full[key].load().tensor.shape, key
        assert torch.allclose(merged, full[key].load().tensor, atol=1e-6, rtol=0), key


def test_fused_swiglu_shards_need_part_by_part_merge(dump):
    """Twin: concatenating gate|up shards whole (tp_parts ignored) puts rows in the wrong place."""
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    parts, record = shards(dump(*TP2), "param_grad", name)
    reference = entries(dump(*CP1))[("param_grad", name)].load().tensor
    assert record.sharding.tp_parts == 2
    assert torch.allclose(merge_tp(parts, record.sharding.tp_dim, 2), reference, atol=1e-6, rtol=0)
    assert not torch.allclose(merge_tp(parts, record.sharding.tp_dim, 1), reference, atol=1e-3, rtol=0)


def test_cp_zigzag_is_undone(dump):
    name = "decoder.layers.1"
    reference = entries(dump(*CP1))[("activation", name)].load().tensor
    merged = entries(dump(*CP2))[("activation", name)].load().tensor
    assert torch.allclose(merged, reference, atol=1e-6, rtol=0)
    dump_cp2 = DumpFiles.open(dump(*CP2))
    halves = [dump_cp2.load(rank, r) for rank in sorted(dump_cp2.ranks, key=lambda k: k.coords.cp_rank)
              for r in rank.records if (r.kind, r.name) == ("activation", name)]
    assert not torch.allclose(torch.cat(halves, dim=0), reference, atol=1e-3, rtol=0)  # twin: no un-zigzag


def _records(path, kind, name):
    dump = DumpFiles.open(path)
    return [(rank, r) for rank in dump.ranks for r in rank.records if (r.kind, r.name) == (kind, name)]
