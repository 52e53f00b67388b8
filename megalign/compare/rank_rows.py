"""Which DP rank's rows of a batch-split tensor differ, where the difference sits in one rank's only.

A tensor split over DP ranks along its batch dim holds each rank's rows in a block of its own (the
shard plan places them: plan.py; a tensor lined up by its real tokens, lineup.py, holds them as a run
of tokens). Where one block differs and the others agree to rounding, the cause is that rank's own:
its random state (dropout left on) or its data, and the row says which rank. Where a rank's block
repeats another rank's while the other side's rows there differ (rows alike by construction, position
ids, are alike there too), the two were fed one shard of data: said even where the shapes differ (with
uneven rows, the repeated rows hold another count of real tokens). The blocks are read from the side
split over more DP ranks (B on a tie). Once parameters or their gradients differ, every rank's rows
differ at the steps after for that cause, whatever each rank's own: no rank is named there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megalign.compare.matching import Pair
from megalign.compare.metrics import tensor_metrics
from megalign.compare.plan import Unassemblable, make_plan
from megalign.dump.format import Kind
from megalign.dump.layout import Layout

CAUSES = "random state, data sharding?"
SAME_SHARD = "data sharding?"


@dataclass(frozen=True)
class RankRows:
    """The DP ranks' blocks of rows of one side's tensor: (DP rank, first row, row after its last) along `dim`."""

    side: str
    dim: int
    blocks: tuple[tuple[int, int, int], ...]

    def note(self, rank: int) -> str:
        return f"only {self.side}'s DP rank {rank} rows differ ({CAUSES})"

    def repeat_note(self, rank: int, other: int) -> str:
        return f"{self.side}'s DP rank {rank} holds the rows of its DP rank {other} ({SAME_SHARD})"


def rank_rows(pair: Pair, layout_a: Optional[Layout], layout_b: Optional[Layout]) -> Optional[RankRows]:
    """The blocks of the pair's side split over more DP ranks; None where neither side is split over DP."""
    found = [rows for rows in (_blocks("A", pair.a, layout_a), _blocks("B", pair.b, layout_b)) if rows is not None]
    return max(reversed(found), key=lambda rows: len(rows.blocks), default=None)


def unname_after_parameters_differ(rows: Sequence) -> None:
    """Takes the note that one rank's rows differ off every row (records.Row, which imports this
    module) after a failing parameter or parameter gradient, the rows in the order of the
    computation: a step's parameters come first, its parameter gradients last."""
    differ = False
    for row in rows:
        if differ:
            row.notes = [note for note in row.notes if not note.endswith(f"rows differ ({CAUSES})")]
        differ = differ or (row.kind in (Kind.PARAM, Kind.PARAM_GRAD) and row.failing)


def is_rank_note(note: str) -> bool:
    return note.endswith((f"rows differ ({CAUSES})", f"({SAME_SHARD})"))


def only_rank(x: torch.Tensor, y: torch.Tensor, rows: RankRows, threshold: float) -> Optional[int]:
    """The one DP rank whose rows differ over `threshold` while every other rank's are within it, or None."""
    if x.shape != y.shape or x.dim() <= rows.dim or rows.blocks[-1][2] != x.shape[rows.dim]:
        return None
    over = [rank for rank, start, stop in rows.blocks
            if not tensor_metrics(x.narrow(rows.dim, start, stop - start),
                                  y.narrow(rows.dim, start, stop - start)).rel_diff <= threshold]
    return over[0] if len(over) == 1 else None


def repeated_rank(tensor: Optional[torch.Tensor], unsplit: Optional[torch.Tensor], rows: RankRows,
                  threshold: float) -> Optional[tuple[int, int]]:
    """(rank, other): the first DP rank whose rows equal an earlier rank's to `threshold` where the
    other side's (`unsplit`) rows at the same places differ, or None. Rows alike by construction
    (position ids, an all-ones loss mask, a learned position embedding's output) are alike on the
    other side too: no shard of data was repeated there. Of another shape (uneven rows lined up by
    their tokens), the other side's two blocks are compared over the rows both hold."""
    if tensor is None or unsplit is None or tensor.dim() <= rows.dim or rows.blocks[-1][2] != tensor.shape[rows.dim]:
        return None
    seen: dict[int, tuple[int, int, torch.Tensor]] = {}
    for rank, start, stop in rows.blocks:
        block = tensor.narrow(rows.dim, start, stop - start)
        for other, (other_start, other_stop, earlier) in seen.items():
            if _alike(earlier, block, threshold) and bool(block.any()) and \
                    not _alike_where_both_are(_rows(unsplit, rows.dim, other_start, other_stop),
                                              _rows(unsplit, rows.dim, start, stop), threshold):
                return rank, other
        seen[rank] = (start, stop, block)
    return None


def _alike(x: torch.Tensor, y: torch.Tensor, threshold: float) -> bool:
    return x.shape == y.shape and tensor_metrics(x, y).rel_diff <= threshold


def _alike_where_both_are(x: torch.Tensor, y: torch.Tensor, threshold: float) -> bool:
    common = min(len(x), len(y))
    return common > 0 and _alike(x[:common], y[:common], threshold)


def _rows(tensor: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop along `dim`, as many of them as the tensor holds (another shape's may hold fewer)."""
    return tensor.movedim(dim, 0)[start:stop] if tensor.dim() > dim else tensor[:0]


def _blocks(side: str, entry, layout: Optional[Layout]) -> Optional[RankRows]:
    if entry is None or layout is None or layout.dp < 2 or not entry.shards:
        return None
    try:
        plan = make_plan(entry.shards, layout)
    except Unassemblable:
        return None  # its row says so already
    split = next((s for s in plan.splits if s.axis == "DP"), None)
    if split is None:
        return None
    blocks = {}
    for piece in plan.pieces:
        for run in dict(piece.runs).get(split.dim, ()):
            blocks.setdefault(piece.coords.dp_rank, (piece.coords.dp_rank, run.start, run.start + run.length))
    ordered = tuple(sorted(blocks.values(), key=lambda block: block[1]))
    if len(ordered) < 2:
        return None
    if entry.lined_up is not None:
        if split.dim != entry.batch_dim:
            return None
        ends = [0, *itertools.accumulate(sum(row.lengths) for row in entry.lined_up)]
        return RankRows(side=side, dim=0, blocks=tuple((rank, ends[start], ends[stop]) for rank, start, stop in ordered))
    return RankRows(side=side, dim=split.dim, blocks=ordered)
