"""Which DP rank's rows of a batch-split tensor differ, where the difference sits in one rank's only.

A tensor split over DP ranks along its batch dim holds each rank's rows in a block of its own (the
shard plan places them: plan.py). Where one block differs and the others agree to rounding, the cause
is that rank's own: its random state (dropout left on) or its data (two ranks on one shard), and the
row says which rank. The blocks are read from the side split over more DP ranks (B on a tie).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megalign.compare.matching import Pair
from megalign.compare.metrics import tensor_metrics
from megalign.compare.plan import Unassemblable, make_plan
from megalign.dump.layout import Layout

CAUSES = "random state, data sharding?"


@dataclass(frozen=True)
class RankRows:
    """The DP ranks' blocks of rows of one side's tensor: (DP rank, first row, row after its last) along `dim`."""

    side: str
    dim: int
    blocks: tuple[tuple[int, int, int], ...]

    def note(self, rank: int) -> str:
        return f"only {self.side}'s DP rank {rank} rows differ ({CAUSES})"


def rank_rows(pair: Pair, layout_a: Optional[Layout], layout_b: Optional[Layout]) -> Optional[RankRows]:
    """The blocks of the pair's side split over more DP ranks; None where neither side is split over DP."""
    found = [rows for rows in (_blocks("A", pair.a, layout_a), _blocks("B", pair.b, layout_b)) if rows is not None]
    return max(reversed(found), key=lambda rows: len(rows.blocks), default=None)


def is_rank_note(note: str) -> bool:
    return note.endswith(f"rows differ ({CAUSES})")


def only_rank(x: torch.Tensor, y: torch.Tensor, rows: RankRows, threshold: float) -> Optional[int]:
    """The one DP rank whose rows differ over `threshold` while every other rank's are within it, or None."""
    if x.shape != y.shape or x.dim() <= rows.dim or rows.blocks[-1][2] != x.shape[rows.dim]:
        return None
    over = [rank for rank, start, stop in rows.blocks
            if not tensor_metrics(x.narrow(rows.dim, start, stop - start),
                                  y.narrow(rows.dim, start, stop - start)).rel_diff <= threshold]
    return over[0] if len(over) == 1 else None


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
    return RankRows(side=side, dim=split.dim, blocks=ordered) if len(ordered) > 1 else None
