"""The layout rules of megalign/dump/layout.py on synthetic inputs: no processes, no model."""

from __future__ import annotations

import pytest
import torch

from megalign.dump.layout import (BatchRow, Layout, cp_bounds, cp_positions, cp_split_bounds, dp_rows, padded_rows,
                                  rank_tokens, zigzag_chunks, zigzag_positions)
from megalign.dump.sharding import merge_cp
from megalign.errors import UserError

PACKED = BatchRow(bounds=(0, 8, 12, 24), lengths=(7, 4, 9))  # three documents, padded to multiples of 4
PADDED = BatchRow(bounds=(0, 16), lengths=(11,))


def test_a_packed_row_is_cut_at_its_documents_or_at_its_ends():
    assert cp_split_bounds(PACKED, "document") == (0, 8, 12, 24)
    assert cp_split_bounds(PACKED, "row") == (0, 24)
    assert cp_split_bounds(PACKED) == (0, 8, 12, 24)  # "document" is the default, as in dump.json


@pytest.mark.parametrize("cp_split", ["document", "row"])
def test_a_padded_row_is_one_document_either_way(cp_split):
    assert cp_split_bounds(PADDED, cp_split) == (0, 16)


def test_a_cp_ranks_piece_is_cut_at_the_documents_or_is_the_whole_row():
    assert cp_bounds((0, 8, 12, 24), 12, 2) == (0, 8, 12, 24)
    assert cp_bounds(None, 6, 4) == (0, 24)


def test_zigzag_chunks():
    assert [zigzag_chunks(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert [zigzag_chunks(r, 3) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]


def test_one_sequence_is_megatrons_zigzag():
    assert cp_positions((0, 8), 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_positions((0, 8), 1, 2).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(4, 1, 2).tolist() == [2, 3, 4, 5]  # from the local length alone


def test_a_packed_row_is_zigzagged_document_by_document():
    assert cp_positions(PACKED.bounds, 0, 2).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]
    assert cp_positions(PACKED.bounds, 1, 2).tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]


def test_without_cp_every_position_in_order():
    assert cp_positions(PACKED.bounds, 0, 1).tolist() == list(range(24))


@pytest.mark.parametrize("cp_split", ["document", "row"])
@pytest.mark.parametrize("cp", [2, 3])
def test_the_ranks_hold_every_position_once_and_merge_cp_undoes_the_split(cp_split, cp):
    row = BatchRow(bounds=(0, 12, 24, 48), lengths=(12, 5, 20))
    bounds = cp_split_bounds(row, cp_split)
    held = [cp_positions(bounds, rank, cp) for rank in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(48))
    full = torch.arange(48 * 2).view(2, 48)
    parts = [full.index_select(1, where) for where in held]
    assert torch.equal(merge_cp(parts, dim=1, bounds=bounds if cp_split == "document" else None), full)


def test_each_dp_rank_takes_its_contiguous_equal_share_of_the_rows():
    assert [dp_rows(8, 4, rank) for rank in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert dp_rows(3, 1, 0) == slice(0, 3)
    assert dp_rows(2, 2, 1) == slice(1, 2)  # packed: one row a DP rank


@pytest.mark.parametrize("rows, dp", [(8, 2), (6, 3), (4, 4), (5, 1)])
def test_the_dp_shares_are_what_chunking_the_batch_gives(rows, dp):
    batch = torch.arange(rows * 3).view(rows, 3)
    for rank, chunk in enumerate(batch.chunk(dp)):
        assert torch.equal(batch[dp_rows(rows, dp, rank)], chunk)


def test_kinds_are_one_list_and_every_kind_table_names_only_kinds():
    from megalign.compare.entries import PHASES
    from megalign.compare.reference import BUDGET
    from megalign.compare.thresholds import DEFAULTS
    from megalign.dump.format import KINDS, Kind

    assert KINDS == tuple(Kind) == ("input", "activation", "activation_grad", "param_grad", "logits", "logprobs",
                                    "loss", "routing", "param")
    for table in (PHASES, *BUDGET.values(), *DEFAULTS.values()):
        assert set(table) <= set(KINDS)


def test_padded_rows_are_read_from_a_right_padded_attention_mask():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert padded_rows(mask, 3, 4) == tuple(BatchRow(bounds=(0, 4), lengths=(n,)) for n in (3, 4, 0))
    assert padded_rows(None, 2, 5) == (BatchRow(bounds=(0, 5), lengths=(5,)),) * 2
    with pytest.raises(UserError, match="real tokens do not come first"):
        padded_rows(torch.tensor([[0, 1, 1], [1, 1, 1]]), 2, 3)  # left padding
    with pytest.raises(UserError, match="real tokens do not come first"):
        padded_rows(torch.tensor([[1, 0, 1]]), 1, 3)  # a hole
    with pytest.raises(UserError, match=r"\[batch, seq\] mask, here \[2, 3\]"):
        padded_rows(torch.ones(2, 1, 3, 3), 2, 3)  # a 4D mask


@pytest.mark.parametrize("tp, cp, dp, sp", [(1, 1, 1, False), (2, 1, 2, True), (2, 2, 1, True), (2, 2, 2, False),
                                            (1, 2, 2, False)])
def test_the_ranks_pieces_of_a_token_tensor_cover_every_token_once_a_tp_group(tp, cp, dp, sp):
    """rank_tokens (the workers cut by it, a replaying run puts the recording back by it): the TP group
    of each (cp, dp) rank holds every token of its rows once under SP, each TP rank all of them without."""
    rows = [BatchRow(bounds=(0, 8, 24), lengths=(8, 14))] * 2
    layout = Layout(tp=tp, cp=cp, dp=dp, sp=sp)
    held = torch.zeros(2, 24, dtype=torch.int64)
    for tp_rank in range(tp):
        for cp_rank in range(cp):
            for dp_rank in range(dp):
                share, positions = rank_tokens(rows, layout, "document", tp_rank, cp_rank, dp_rank, sp)
                held[share][:, positions] += 1
    assert held.eq(1 if sp else tp).all()
