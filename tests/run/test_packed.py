"""Packed (THD) rows: documents of uneven lengths packed into one row, split over CP per document.

Real megatron-core workers on gloo. A packed run is lined up with the padded single-rank run of the
same documents token by token (compare/lineup.py) and must agree within the fp32 tolerance: every
activation, activation gradient, parameter gradient, logits, logprobs and loss. The failing twin
splits the row over CP as one long sequence while attention and RoPE expect documents.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import invoke
from test_run_layouts import TINY_PARAMETERS, TOLERANCE

from megalign.compare.lineup import line_up
from megalign.compare.sources import open_source
from megalign.dump.sharding import cp_positions

LENGTHS = (13, 30, 7, 22)  # uneven, two of them odd: padding between documents at CP=2
LAYOUTS = {
    "cp1": (),
    "cp2": ("--cp", "2"),
    "tp2-sp-cp2": ("--tp", "2", "--sp", "--cp", "2"),
}


@pytest.fixture(scope="session")
def documents(tmp_path_factory):
    generator = torch.Generator().manual_seed(5)
    path = tmp_path_factory.mktemp("documents") / "docs.json"
    path.write_text(json.dumps([torch.randint(1, 128, (n,), generator=generator).tolist() for n in LENGTHS]))
    return path


def lined_up_diffs(a, b) -> dict[tuple[str, str], float]:
    """Max |a - b| of every tensor both dumps hold, token by token where their batches differ."""
    source_a, source_b, _ = line_up(open_source(a), open_source(b), None)
    in_b = {(e.kind, e.name): e for e in source_b.entries if not e.apart}
    diffs = {}
    for entry in source_a.entries:
        other = in_b.get((entry.kind, entry.name))
        if other is not None and not entry.apart:
            x, y = entry.load().tensor, other.load().tensor
            assert x.shape == y.shape, (entry.kind, entry.name, x.shape, y.shape)
            diffs[entry.kind, entry.name] = (x.double() - y.double()).abs().max().item()
    return diffs


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_packed_run_matches_the_padded_single_rank_run(dump, documents, layout):
    padded = dump("backward", "--tokens", documents)
    packed = dump("backward", "--tokens", documents, "--packed", *LAYOUTS[layout])
    diffs = lined_up_diffs(padded, packed)
    assert not {key: d for key, d in diffs.items() if d > TOLERANCE}
    assert sum(kind == "param_grad" for kind, _ in diffs) == TINY_PARAMETERS
    assert sum(kind == "activation_grad" for kind, _ in diffs) >= 20
    assert sum(kind == "activation" for kind, _ in diffs) >= 20
    assert {("loss", "loss"), ("logprobs", "logprobs"), ("logits", "logits"), ("input", "tokens")} <= set(diffs)
    result = invoke("compare", padded, packed)
    assert result.exit_code == 0, result.output
    assert "1 not lined up" in result.output  # the RoPE table: positions, not tokens


def test_the_dump_records_the_documents(dump, documents):
    meta = json.loads((dump("backward", "--tokens", documents, "--packed", "--cp", "2") / "dump.json").read_text())
    # each document padded to a multiple of 2*cp = 4; the last one on to the row's end
    assert meta["packed"] and meta["cp_split"] == "document"
    assert meta["rows"] == [{"bounds": [0, 16, 48, 56, 80], "lengths": list(LENGTHS)}]
    tokens = open_source(dump("backward", "--tokens", documents, "--packed", "--cp", "2"))
    loss_mask = next(e for e in tokens.entries if e.name == "loss_mask").load().tensor
    assert loss_mask.shape == (1, 80) and loss_mask.sum().item() == sum(LENGTHS) - len(LENGTHS)


def test_the_row_split_as_one_sequence_is_caught_at_the_first_attention(dump, documents):
    """The failing twin: megatron's per-sequence zigzag on a packed row (use_per_sequence_balancing)
    while attention and RoPE cut by document. Inputs still line up; layer 0's attention does not."""
    buggy = dump("backward", "--tokens", documents, "--packed", "--cp", "2", "--packed-split", "row")
    result = invoke("compare", dump("backward", "--tokens", documents), buggy)
    assert result.exit_code == 1, result.output
    assert "first divergence: activation decoder.layers.0.self_attention.core_attention" in result.output
    diffs = lined_up_diffs(dump("backward", "--tokens", documents), buggy)
    assert diffs["input", "tokens"] == 0 and diffs["activation", "decoder.layers.0.self_attention.linear_qkv"] == 0
    assert diffs["activation", "decoder.layers.0.self_attention.core_attention"] > 100 * TOLERANCE


def test_cp_positions_are_tes_partitioned_indices():
    """megatron's own example for thd_get_partitioned_indices: cu_seqlens [0, 4, 8], CP=2, rank 0 holds
    [0, 3, 4, 7]; the zigzag of a single sequence is the special case of one document."""
    assert cp_positions([0, 4, 8], 0, 2).tolist() == [0, 3, 4, 7]
    assert cp_positions([0, 4, 8], 1, 2).tolist() == [1, 2, 5, 6]
    assert cp_positions([0, 8, 16], 1, 2).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert cp_positions([0, 5, 12], 0, 1).tolist() == list(range(12))
