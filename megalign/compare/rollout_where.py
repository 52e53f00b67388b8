"""Where a rollout's logprob mismatch sits: each region of the response tokens with its share of the
tokens and its share of the |Δlogprob| mass. A region holding at least OVER times its share of the
tokens' mass is over-represented: the gap gathers there (a bug at CP shard edges, at the first
response token, at packed documents' edges, or late in long sequences), rather than spreading evenly.

The regions, on the [sequence, position] grid of rollout_pair (position t holds the logprob of token
t+1, as the trainer computes it at position t):
- position buckets: positions 0-15, 16-31, 32-63, ... (doubling);
- the first response token of each sequence;
- CP shard edges (a CP run): the positions on either side of a cut between two of the 2*CP chunks
  each sequence (or packed row, under cp_split "row") is zigzagged in;
- packed-document edges (a packed run): the first two and last two positions of a document that
  shares its row with another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megalign.dump.layout import BatchRow, cp_split_bounds

OVER = 2.0  # a region holding twice its share of the tokens' |Δ| mass or more is over-represented
FIRST_BUCKET = 16
DOCUMENT_EDGE = 2  # positions at each end of a document counted as its edge


@dataclass
class Region:
    name: str
    tokens: int  # response tokens compared in it
    token_share: float  # of all response tokens compared
    mass_share: float  # of the sum of |Δlogprob| over them
    mean_abs_diff: float
    max_abs_diff: float
    over_represented: bool


def regions(delta: torch.Tensor, keep: torch.Tensor, loss_mask: torch.Tensor, rows: Optional[list[BatchRow]],
            cp: int, cp_split: Optional[str]) -> list[Region]:
    """Every region with a response token in it; `delta` trainer - rollout on the [sequence, position]
    grid (metrics.logprob_gap: NaN already inf), `keep` the response positions compared, `rows` the
    trainer's batch rows (None: not known)."""
    masks = _buckets(keep.shape) + [("first response token", _first_response(loss_mask))]
    if rows is not None and cp > 1:
        masks.append((f"CP shard edges (CP={cp})", _cp_edges(keep.shape, rows, cp, cp_split)))
    if rows is not None and any(len(row.lengths) > 1 for row in rows):
        masks.append(("packed-document edges", _document_edges(keep.shape, rows)))
    size = delta.abs()
    total_tokens = int(keep.sum())
    found = []
    for name, mask in masks:
        inside = mask & keep
        count = int(inside.sum())
        if count == 0:
            continue
        mass = float(size[inside].sum())
        token_share = count / total_tokens
        mass_share = _mass_share(size[inside], size[keep])
        found.append(Region(name=name, tokens=count, token_share=token_share, mass_share=mass_share,
                            mean_abs_diff=mass / count, max_abs_diff=float(size[inside].max()),
                            over_represented=token_share < 1 and mass_share >= OVER * token_share))
    return found


def _mass_share(part: torch.Tensor, whole: torch.Tensor) -> float:
    """part's share of whole's Σ|Δ|; where that is infinite (a non-finite logprob), part's share of the
    infinite tokens: inf / inf would print as nan%."""
    infinite = int(whole.isinf().sum())
    if infinite:
        return int(part.isinf().sum()) / infinite
    total = float(whole.sum())
    return float(part.sum()) / total if total > 0 else 0.0


def _buckets(shape: torch.Size) -> list[tuple[str, torch.Tensor]]:
    position = torch.arange(shape[1]).expand(shape)
    found, start, end = [], 0, FIRST_BUCKET
    while start < shape[1]:
        found.append((f"positions {start}-{end - 1}", (position >= start) & (position < end)))
        start, end = end, 2 * end
    return found


def _first_response(loss_mask: torch.Tensor) -> torch.Tensor:
    first = torch.zeros(loss_mask.shape, dtype=torch.bool)
    on = loss_mask > 0
    has = on.any(dim=1)
    first[has.nonzero().flatten(), on.int().argmax(dim=1)[has]] = True
    return first


def _documents(rows: list[BatchRow]):
    """(row, start in the row, length) of every document, in the rollout's sequence order."""
    return [(r, start, length) for r, row in enumerate(rows) for start, length in zip(row.bounds, row.lengths)]


def _cp_edges(shape: torch.Size, rows: list[BatchRow], cp: int, cp_split: Optional[str]) -> torch.Tensor:
    cuts: list[set[int]] = []  # per row: the row positions on either side of a cut between zigzag chunks
    for row in rows:
        bounds = cp_split_bounds(row, cp_split or "document")
        at = set()
        for start, end in zip(bounds[:-1], bounds[1:]):
            chunk = (end - start) // (2 * cp)
            for k in range(1, 2 * cp):
                at |= {start + k * chunk - 1, start + k * chunk}
        cuts.append(at)
    edges = torch.zeros(shape, dtype=torch.bool)
    for sequence, (r, start, length) in enumerate(_documents(rows)[:shape[0]]):
        for q in cuts[r]:
            if start <= q < start + min(length, shape[1]):
                edges[sequence, q - start] = True
    return edges


def _document_edges(shape: torch.Size, rows: list[BatchRow]) -> torch.Tensor:
    edges = torch.zeros(shape, dtype=torch.bool)
    for sequence, (r, _, length) in enumerate(_documents(rows)[:shape[0]]):
        if len(rows[r].lengths) > 1:
            edges[sequence, :min(DOCUMENT_EDGE, length)] = True
            edges[sequence, max(0, length - DOCUMENT_EDGE):length] = True
    return edges
