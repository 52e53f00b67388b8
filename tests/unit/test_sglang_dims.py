"""sglang dims (compare/sources/sglang_dims.py) as plans (compare/plan.py), carried out on tensors cut
by hand as sglang's ranks hold them: no processes, no files."""

from __future__ import annotations

import itertools

import pytest
import torch

from megalign.compare.entries import Value
from megalign.compare.plan import Holder, Unassemblable, place
from megalign.compare.reassemble import execute, in_memory
from megalign.compare.sources.sglang_dims import non_empty, parse_dims, rank_coords, sharded
from megalign.dump.layout import cp_positions

WHOLE = torch.arange(16 * 6, dtype=torch.float32).reshape(16, 6)  # s h


def cut(cp: int, sp: int, tp: int) -> dict[int, tuple[dict, torch.Tensor]]:
    """Each rank's (parallel info, shard) of WHOLE as `s[cp:zigzag,sp] h[tp]`: CP's zigzag positions,
    SP's contiguous piece of them, TP's columns."""
    shards = {}
    for rank, (c, s, t) in enumerate(itertools.product(range(cp), range(sp), range(tp))):
        rows = WHOLE[cp_positions((0, 16), c, cp)].chunk(sp)[s]
        info = {"cp_rank": c, "cp_size": cp, "sp_rank": s, "sp_size": sp, "tp_rank": t, "tp_size": tp}
        shards[rank] = (info, rows.chunk(tp, dim=1)[t].clone())
    return shards


def assembled(dims: str, shards: dict[int, tuple[dict, torch.Tensor]]) -> torch.Tensor:
    infos = [info for info, _ in shards.values()]
    split = sharded(parse_dims(dims), infos)
    plan = place([Holder(coords=rank_coords(rank, info), at=split.at(info), shape=tuple(t.shape))
                  for rank, (info, t) in shards.items()], split.splits, split.summed)
    value = execute(plan, in_memory(lambda coords: shards[coords.rank][1]), Value(list(plan.shape), "float32"),
                    torch.float32)
    return value.tensor


def test_cp_zigzag_then_sp_then_tp_is_put_back_together():
    assert torch.equal(assembled("s[cp:zigzag,sp] h[tp]", cut(2, 2, 2)), WHOLE)


def test_the_modifiers_order_matters():
    """The twin: SP listed outside CP places the rows elsewhere; natural order leaves the zigzag in."""
    assert not torch.equal(assembled("s[sp,cp:zigzag] h[tp]", cut(2, 2, 2)), WHOLE)
    assert not torch.equal(assembled("s[cp,sp] h[tp]", cut(2, 2, 2)), WHOLE)


def test_partial_pieces_are_summed_and_unsplit_axes_hold_replicas():
    parts = {0: ({"tp_rank": 0, "tp_size": 2, "cp_rank": 0, "cp_size": 2}, WHOLE * 0.25),
             1: ({"tp_rank": 1, "tp_size": 2, "cp_rank": 0, "cp_size": 2}, WHOLE * 0.75),
             2: ({"tp_rank": 0, "tp_size": 2, "cp_rank": 1, "cp_size": 2}, WHOLE * 0.25),
             3: ({"tp_rank": 1, "tp_size": 2, "cp_rank": 1, "cp_size": 2}, WHOLE * 0.75)}
    infos = [info for info, _ in parts.values()]
    split = sharded(parse_dims("s h[tp:partial]"), infos)
    plan = place([Holder(coords=rank_coords(r, info), at=split.at(info), shape=tuple(t.shape))
                  for r, (info, t) in parts.items()], split.splits, split.summed)
    (piece,) = plan.pieces
    assert piece.coords.rank == 0 and [c.rank for c in piece.terms] == [1]
    assert [(r.coords.rank, [c.rank for c in r.terms]) for r in piece.replicas] == [(2, [3])]
    assert torch.equal(assembled("s h[tp:partial]", parts), WHOLE)


def test_megatron_sequence_parallelism_reads_the_tp_ranks():
    shards = {rank: ({k: v for k, v in info.items() if not k.startswith("sp_")}, t)
              for rank, (info, t) in cut(1, 2, 1).items()}
    shards = {rank: ({**info, "tp_rank": rank, "tp_size": 2}, t) for rank, (info, t) in shards.items()}
    assert torch.equal(assembled("s[sp] h", shards), WHOLE)


def test_a_missing_rank_and_an_unknown_axis_are_refused():
    shards = cut(2, 1, 2)
    del shards[3]
    with pytest.raises(Unassemblable, match=r"has 3 of the 4 shards its split \(2 CP x 2 TP\) makes"):
        assembled("s[cp:zigzag] h[tp]", shards)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        parse_dims("s h[xp]")


def test_the_hash_section_reads_as_sglangs_comparator_reads_it():
    dims = parse_dims("t h[attn_tp] # dp:=attn_dp ep:replicated")
    assert dims.dp_axis == "attn_dp" and dims.replicated == {"ep"} and dims.ndim == 2
    assert parse_dims("t h").dp_axis == "dp"
    for bad, message in [("t h # tp:replicatd", "'tp:replicatd' after '#' is neither"),
                         ("t h # dp:=attn_dp dp:=moe_dp", "or says it again"),
                         ("t h # xp:replicated", "unknown axis 'xp'"),
                         ("t h[tp] # tp:replicated", "tp declared both sharded and replicated"),
                         ("t h[tp,tp]", "an axis named twice")]:
        with pytest.raises(ValueError, match=message):
            parse_dims(bad)


def test_only_the_dp_rank_that_holds_the_tensor_is_kept_beside_idle_ones():
    dims = parse_dims("t h # dp:=attn_dp")
    infos = [{"attn_dp_rank": r, "attn_dp_size": 2, "tp_rank": t, "tp_size": 2} for r in range(2) for t in range(2)]
    assert non_empty(dims, infos, [(4, 6), (4, 6), (0, 6), (0, 6)]) == [0, 1]
    assert non_empty(dims, infos, [(4, 6)] * 4) == [0, 1, 2, 3]  # every DP rank holds it: replicas
    with pytest.raises(ValueError, match="2 of its attn_dp ranks hold it"):
        non_empty(dims, [{"attn_dp_rank": r, "attn_dp_size": 3} for r in range(3)], [(4, 6), (4, 6), (0, 6)])
