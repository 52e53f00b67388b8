"""Where a rollout's mismatch sits (compare/rollout_where.py), on synthetic grids whose CP chunks and
packed documents are known: a gap planted at CP shard edges or at documents' edges is over-represented
there; spread evenly, nowhere."""

from __future__ import annotations

import torch

from megalign.compare.rollout_where import regions
from megalign.dump.layout import BatchRow

# Two sequences of 16 tokens, each its own row (padded) at CP=2: 4 chunks of 4, cuts at 4, 8 and 12.
PADDED = [BatchRow((0, 16), (16,)), BatchRow((0, 16), (16,))]
CP_EDGES = [3, 4, 7, 8, 11, 12]
# The same two packed into one row of two documents.
PACKED = [BatchRow((0, 16, 32), (16, 16))]


def _grid():
    mask = torch.zeros(2, 16)
    mask[:, 2:15] = 1  # the response: positions 2..14 predict tokens 3..15
    noise = torch.randn(2, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64).abs() * 1e-5
    return noise, mask > 0, mask


def _by_name(found):
    return {r.name: r for r in found}


def test_even_noise_is_over_represented_nowhere():
    delta, keep, mask = _grid()
    found = _by_name(regions(delta, keep, mask, PACKED, 2, "document"))
    assert set(found) == {"positions 0-15", "first response token", "CP shard edges (CP=2)", "packed-document edges"}
    assert found["positions 0-15"].tokens == 26 and found["first response token"].tokens == 2
    assert not any(r.over_represented for r in found.values())


def test_a_gap_at_cp_shard_edges_is_over_represented_there():
    delta, keep, mask = _grid()
    delta[:, CP_EDGES] += 0.1
    found = _by_name(regions(delta, keep, mask, PADDED, 2, None))
    edges = found["CP shard edges (CP=2)"]
    assert edges.over_represented and edges.tokens == 12 and edges.mass_share > 0.99
    assert not found["first response token"].over_represented and "packed-document edges" not in found
    # The twin's control: the same gap one position inside the chunks is no edge gap.
    delta, keep, mask = _grid()
    delta[:, [5, 10]] += 0.1
    assert not _by_name(regions(delta, keep, mask, PADDED, 2, None))["CP shard edges (CP=2)"].over_represented


def test_a_gap_at_packed_document_edges_is_over_represented_there():
    delta, keep, mask = _grid()
    delta[:, 13:15] += 0.1  # the last two positions compared in each document
    found = _by_name(regions(delta, keep, mask, PACKED, 1, None))
    assert found["packed-document edges"].over_represented and "CP shard edges (CP=2)" not in found
    # Under cp_split "row" the packed row is cut as one sequence of 32: cuts at 8, 16 and 24.
    cut = _by_name(regions(delta, keep, mask, PACKED, 2, "row"))["CP shard edges (CP=2)"]
    assert cut.tokens == 4  # positions 7, 8 of each document (15 and 16 fall outside the compared response)
