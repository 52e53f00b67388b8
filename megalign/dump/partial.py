"""Partial values given to add() (`Sharding(partial="sum" | "mean")`): each rank holds a part of the
tensor, the whole being their sum or mean over the ranks that hold other data (DP and CP ranks; TP
ranks and pipeline stages hold replicas of it). A per-rank loss is one; the gradient of an output
that every row of a DP rank's batch shares (GPT-2's learned position embedding, [1, seq, d]) is
another, summed over each rank's rows.

Recorded as a DTensor's Partial(sum) piece is (dump-format.md's `mesh`), on a mesh of the layout's
(pp, dp, cp, tp) ranks: compare sums such pieces already (compare/plan.py), and checks the replicas.
A mean is written as each rank's share of it, its value over the number of parts, whose sum is the
mean: nothing new to read.
"""

from __future__ import annotations

from typing import Optional

import torch

from megalign.dump.format import RankCoords
from megalign.dump.layout import Layout
from megalign.dump.sharding import MeshPlacement, Sharding

PARTIALS = ("sum", "mean")


def check_partial(sharding: Sharding, what: str) -> None:
    """ValueError where `partial` is not one of PARTIALS or is given beside a split (a partial value is whole in shape)."""
    if sharding.partial not in PARTIALS:
        raise ValueError(f"{what}: Sharding(partial=) is \"sum\" or \"mean\", got {sharding.partial!r}")
    if (sharding.seq_dim, sharding.tp_dim, sharding.dp_dim, sharding.sp, sharding.mesh) != (None, None, None, False,
                                                                                             None):
        raise ValueError(f"{what}: Sharding(partial=) says every rank holds a part of the whole tensor: give no "
                         "dims beside it")


def partial_piece(tensor: torch.Tensor, sharding: Sharding, coords: RankCoords,
                  layout: Layout) -> tuple[torch.Tensor, Sharding]:
    """This rank's part as written, and its mesh piece."""
    parts = layout.dp * layout.cp
    if sharding.partial == "mean" and parts > 1:
        tensor = tensor / parts
    whole = tuple(tensor.shape)
    mesh = MeshPlacement(shape=(layout.pp, layout.dp, layout.cp, layout.tp),
                         coord=(coords.pp_rank, coords.dp_rank, coords.cp_rank, coords.tp_rank),
                         placements=("R", "P", "P", "R"), whole=whole, offset=(0,) * len(whole))
    return tensor, Sharding(mesh=mesh)


def shared_output_grad(layout: Sharding) -> Optional[Sharding]:
    """The gradient's sharding of an output every DP rank holds whole (not split by rows, no TP or
    mesh piece) while each holds other rows: a partial sum over them; None where it lies as the output does."""
    if (layout.dp_dim, layout.tp_dim, layout.sp, layout.mesh, layout.partial) == (None, None, False, None, None):
        return Sharding(partial="sum")
    return None
