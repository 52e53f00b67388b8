"""Reassembly plans (megalign/compare/plan.py) of synthetic shards: no processes, no files.

Each plan is checked against the runs worked out by hand, and against the one property every plan
must have: every position of the whole tensor is covered by exactly one placed shard."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from megalign.compare.plan import RankRecord, Replica, Unassemblable, make_plan
from megalign.dump.format import RankCoords, TensorRecord
from megalign.dump.layout import Layout
from megalign.dump.reader import RankManifest
from megalign.dump.sharding import Sharding


def shard(rank: int, shape, sharding: Sharding, tp: int = 0, cp: int = 0, dp: int = 0, hash=None) -> RankRecord:
    coords = RankCoords(rank=rank, tp_rank=tp, cp_rank=cp, dp_rank=dp)
    record = TensorRecord(kind="activation", name="x", order=0, shape=list(shape), dtype="float32",
                          sharding=sharding, file="tensors-00000.safetensors", key="x", hash=hash)
    return RankRecord(RankManifest(dir=Path("."), coords=coords, records=[record]), record)


def runs_by_rank(plan) -> dict[int, dict[int, list[tuple[int, int, int]]]]:
    return {p.coords.rank: {dim: [tuple(r) for r in runs] for dim, runs in p.runs} for p in plan.pieces}


def covered(plan) -> torch.Tensor:
    """How many placed shards cover each position of the whole tensor."""
    counts = torch.zeros(plan.shape, dtype=torch.int64)
    for piece in plan.pieces:
        runs = dict(piece.runs)
        dims = sorted(runs)
        for combo in itertools.product(*(runs[d] for d in dims)):
            view = counts
            for dim, run in zip(dims, combo):
                view = view.narrow(dim, run.start, run.length)
            view += 1
    return counts


SEQ = Sharding(seq_dim=0)


def test_cp2_undoes_the_zigzag():
    plan = make_plan([shard(0, [4, 3], SEQ, cp=0), shard(1, [4, 3], SEQ, cp=1)], Layout(cp=2))
    assert plan.shape == (8, 3)
    assert runs_by_rank(plan) == {0: {0: [(0, 0, 2), (2, 6, 2)]}, 1: {0: [(0, 2, 4)]}}
    assert (covered(plan) == 1).all()


def test_fused_tp_shards_are_placed_part_by_part():
    fused = Sharding(tp_dim=0, tp_parts=2)  # gate|up: each part split over the TP ranks on its own
    plan = make_plan([shard(0, [4, 5], fused, tp=0), shard(1, [4, 5], fused, tp=1)], Layout(tp=2))
    assert plan.shape == (8, 5)
    assert runs_by_rank(plan) == {0: {0: [(0, 0, 2), (2, 4, 2)]}, 1: {0: [(0, 2, 2), (2, 6, 2)]}}
    assert (covered(plan) == 1).all()


def test_fused_shards_placed_whole_would_be_caught():
    """Twin: placed as one part, tp_rank 1's rows land where the plan puts the gate's second half."""
    plain = make_plan([shard(0, [4, 5], Sharding(tp_dim=0)), shard(1, [4, 5], Sharding(tp_dim=0), tp=1)],
                      Layout(tp=2))
    fused = make_plan([shard(0, [4, 5], Sharding(tp_dim=0, tp_parts=2)),
                       shard(1, [4, 5], Sharding(tp_dim=0, tp_parts=2), tp=1)], Layout(tp=2))
    assert runs_by_rank(plain)[1] != runs_by_rank(fused)[1]


def test_sp_pieces_sit_within_their_cp_ranks_piece():
    sp = Sharding(seq_dim=0, sp=True)
    shards = [shard(2 * cp + tp, [2, 3], sp, tp=tp, cp=cp) for cp in range(2) for tp in range(2)]
    plan = make_plan(shards, Layout(tp=2, cp=2, sp=True))
    assert plan.shape == (8, 3)
    # CP rank 0 holds positions 0,1,6,7 (zigzag); its TP ranks hold two of them each, in order.
    assert runs_by_rank(plan) == {0: {0: [(0, 0, 2)]}, 1: {0: [(0, 6, 2)]}, 2: {0: [(0, 2, 2)]},
                                  3: {0: [(0, 4, 2)]}}
    assert (covered(plan) == 1).all()


def test_dp_ranks_hold_their_rows_in_order():
    batch = Sharding(seq_dim=1, dp_dim=0)
    plan = make_plan([shard(0, [2, 4], batch, dp=0), shard(1, [2, 4], batch, dp=1)], Layout(dp=2))
    assert plan.shape == (4, 4)
    assert runs_by_rank(plan) == {0: {0: [(0, 0, 2)]}, 1: {0: [(0, 2, 2)]}}


def test_a_packed_row_is_undone_document_by_document():
    bounds = (0, 8, 12, 24)
    plan = make_plan([shard(0, [12], SEQ, cp=0), shard(1, [12], SEQ, cp=1)], Layout(cp=2),
                     row_bounds=lambda dp_rank: bounds)
    # rank 0 holds 0,1 | 6,7 of the first document, 8 | 11 of the second, 12,13,14 | 21,22,23 of the third
    assert runs_by_rank(plan)[0] == {0: [(0, 0, 2), (2, 6, 3), (5, 11, 4), (9, 21, 3)]}
    assert (covered(plan) == 1).all()
    whole_row = make_plan([shard(0, [12], SEQ, cp=0), shard(1, [12], SEQ, cp=1)], Layout(cp=2))
    assert runs_by_rank(whole_row) != runs_by_rank(plan)  # twin: the row zigzagged as one sequence


def test_cp_tp_and_dp_together_cover_every_position_once():
    sharding = Sharding(seq_dim=1, tp_dim=2, dp_dim=0)
    shards = [shard(rank, [1, 4, 3], sharding, tp=tp, cp=cp, dp=dp)
              for rank, (dp, cp, tp) in enumerate(itertools.product(range(2), range(2), range(2)))]
    plan = make_plan(shards, Layout(tp=2, cp=2, dp=2))
    assert plan.shape == (2, 8, 6) and len(plan.pieces) == 8
    assert (covered(plan) == 1).all()


def test_ranks_a_tensor_is_not_split_over_are_replicas_read_unless_their_hashes_match():
    same, other = "0" * 32, "1" * 32
    shards = [shard(0, [4], Sharding(), tp=0, hash=same), shard(1, [4], Sharding(), tp=1, hash=same),
              shard(2, [4], Sharding(), tp=2, hash=other), shard(3, [4], Sharding(), tp=3)]
    plan = make_plan(shards, Layout(tp=4))
    (piece,) = plan.pieces
    assert piece.coords.rank == 0 and piece.runs == ()
    assert [(r.coords.rank, r.read) for r in piece.replicas] == [(1, False), (2, True), (3, True)]
    assert isinstance(piece.replicas[0], Replica)


def test_a_missing_shard_is_unassemblable():
    with pytest.raises(Unassemblable, match=r"has 1 of the 4 shards its split \(2 TP x 2 CP\) makes"):
        make_plan([shard(0, [4, 3], Sharding(seq_dim=0, tp_dim=1))], Layout(tp=2, cp=2))


def test_shards_that_do_not_make_up_the_whole_are_unassemblable():
    """Two ranks claiming one TP rank of a TP-split tensor: the shape counts both, the plan places one."""
    with pytest.raises(Unassemblable, match=r"has shards of 4 that do not make up its 8 \(ranks that claim the same place\)"):
        make_plan([shard(0, [4], Sharding(tp_dim=0)), shard(1, [4], Sharding(tp_dim=0))], Layout(pp=2))


def test_replicas_of_different_shapes_are_unassemblable():
    with pytest.raises(Unassemblable, match=r"replicas of different shapes \[\(4,\), \(5,\)\]"):
        make_plan([shard(0, [4], Sharding()), shard(1, [5], Sharding(), tp=1)], Layout(tp=2))


def test_the_plan_explains_itself_rank_by_rank():
    shards = [shard(2 * cp + tp, [4, 3], SEQ, tp=tp, cp=cp, hash="0" * 32) for cp in range(2) for tp in range(2)]
    assert make_plan(shards, Layout(tp=2, cp=2)).explain() == [
        "8x3 from 2 pieces of 4x3; CP 2 along dim 0 (zigzag)",
        "  rank 0 (tp 0 cp 0 dp 0 pp 0): dim 0 [0:2] -> [0:2], [2:4] -> [6:8]",
        "  rank 1 (tp 1 cp 0 dp 0 pp 0): replica of rank 0, same hash: not read",
        "  rank 2 (tp 0 cp 1 dp 0 pp 0): dim 0 [0:4] -> [2:6]",
        "  rank 3 (tp 1 cp 1 dp 0 pp 0): replica of rank 2, same hash: not read",
    ]

