"""A tensor laid out by tokens (its records name a sequence dim and a batch dim: the input tokens, the
routers' choices) put back together from every rank of a dump, as a run reads another run's dump
(--routing replay).

Each rank's piece lies where layout.rank_tokens says, the rule the workers cut by; ranks holding the
same tokens (TP ranks without SP, EP ranks within them) are replicas and the first is read. compare
puts back every kind of tensor (compare/plan.py) and checks the replicas against each other.
"""

from __future__ import annotations

import torch

from megalign.dump.format import TensorRecord
from megalign.dump.layout import rank_tokens
from megalign.dump.reader import DumpFiles, RankManifest


class Unplaced(ValueError):
    """The pieces are not a token tensor's, or leave tokens of the batch out."""


def read_token_tensor(dump: DumpFiles, pieces: list[tuple[RankManifest, TensorRecord]]) -> torch.Tensor:
    """The whole tensor: the batch's rows on its batch dim, their positions on its sequence dim."""
    first = pieces[0][1]
    sharding = first.sharding
    if first.file is None:
        raise Unplaced("no values (a --stats-only dump)")
    if dump.rows is None or sharding.seq_dim is None or sharding.dp_dim is None or sharding.tp_dim is not None \
            or sharding.mesh is not None:
        raise Unplaced("not laid out by the batch's tokens (a sequence dim and a batch dim)")
    dims = (sharding.dp_dim, sharding.seq_dim)
    shape = list(first.shape)
    shape[sharding.dp_dim], shape[sharding.seq_dim] = len(dump.rows), dump.rows[0].bounds[-1]
    whole = torch.empty(shape, dtype=dump.locate(*pieces[0]).dtype)
    placed = torch.zeros(shape[sharding.dp_dim], shape[sharding.seq_dim], dtype=torch.bool)
    moved = whole.movedim(dims, (0, 1))
    for rank, record in pieces:
        c = rank.coords
        share, positions = rank_tokens(dump.rows, dump.layout, dump.meta["cp_split"], c.tp_rank, c.cp_rank,
                                       c.dp_rank, sharding.sp)
        if placed[share][:, positions].all():
            continue  # a replica of pieces already read
        piece = dump.load(rank, record).movedim(dims, (0, 1))
        if piece.shape != (share.stop - share.start, len(positions), *moved.shape[2:]):
            raise Unplaced(f"rank {c.rank}'s piece {list(record.shape)} does not hold its "
                           f"{share.stop - share.start} rows of {len(positions)} tokens")
        moved[share][:, positions] = piece
        placed[share][:, positions] = True
    if not placed.all():
        raise Unplaced("the ranks' pieces leave tokens of the batch out")
    return whole
