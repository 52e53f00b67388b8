"""What every stack runs on: the batch (padded or packed), and how its token losses become the loss.

The batch is built on the full rows before any CP split, so that labels (the next token of the same
document) and the loss mask are the same for every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megalign.dump.layout import BatchRow, dp_rows
from megalign.errors import UserError
from megalign.spec import RunSpec

def mean_token_loss(per_token: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The masked token losses summed and divided by `count` valid tokens: every stack's normalisation."""
    return (per_token.float() * mask).sum() / count.clamp(min=1)


@dataclass
class BatchTensors:
    """[batch, seq] tensors: tokens, next-token labels, loss mask (0 on padding and last token), positions."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens, "labels": self.labels, "loss_mask": self.loss_mask,
                "position_ids": self.position_ids}


def batch_rows(spec: RunSpec) -> list[BatchRow]:
    """The rows a run feeds the model: one padded sequence a row, or (--packed) one packed row a DP rank."""
    if spec.packed:
        return packed_rows(spec.tokens, spec.seq_len, spec.layout.dp, spec.layout.packing_multiple)
    return rows_of_sequences(spec.tokens, spec.seq_len)


def rows_of_sequences(tokens: list[list[int]], seq_len: int) -> list[BatchRow]:
    """One sequence a row, right-padded to seq_len."""
    return [BatchRow(bounds=(0, seq_len), lengths=(len(seq),)) for seq in tokens]


def packed_rows(tokens: list[list[int]], seq_len: int, rows: int, multiple: int) -> list[BatchRow]:
    """The sequences split into `rows` equal runs (one a DP rank), each run packed into one row of
    seq_len tokens: every document padded to a multiple of `multiple` (CP's zigzag cuts each into
    2*cp chunks), the last one on to the row's end."""
    result = []
    for first, share in _shares(tokens, rows):
        padded = [_round_up(len(seq), multiple) for seq in share]
        if sum(padded) > seq_len:
            raise UserError(f"--packed: sequences {first}..{first + len(share) - 1} take {sum(padded)} tokens once "
                            f"each is padded to a multiple of {multiple}; --seq-len {seq_len} does not hold them")
        bounds = [0]
        for n in padded[:-1]:
            bounds.append(bounds[-1] + n)
        result.append(BatchRow(bounds=tuple(bounds) + (seq_len,), lengths=tuple(len(seq) for seq in share)))
    return result


def packed_length(tokens: list[list[int]], rows: int, multiple: int) -> int:
    """The shortest row that holds every row's documents, each padded to a multiple of `multiple`."""
    return max(sum(_round_up(len(seq), multiple) for seq in share) for _, share in _shares(tokens, rows))


def _shares(tokens: list[list[int]], rows: int):
    """(first sequence, sequences) of each row: a DP rank's share of the sequences, packed into one row."""
    shares = [dp_rows(len(tokens), rows, rank) for rank in range(rows)]
    return [(share.start, tokens[share]) for share in shares]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_batch(tokens: list[list[int]], rows: list[BatchRow],
                label_mask: Optional[list[list[int]]] = None) -> BatchTensors:
    """The documents placed in their rows, in order; padding is token 0. Labels are the next token of
    the same document, positions restart at every document, and causal attention (within a document,
    for packed rows) keeps real tokens from seeing the padding. `label_mask` (a rollout's response
    positions, one 0/1 per token of each document) narrows the loss mask."""
    width = rows[0].bounds[-1]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.zeros_like(ids)
    loss_mask = torch.zeros(len(rows), width)
    positions = torch.zeros_like(ids)
    documents = iter(tokens)
    masks = iter(label_mask) if label_mask is not None else None
    for r, row in enumerate(rows):
        for start, end, length in zip(row.bounds[:-1], row.bounds[1:], row.lengths):
            seq = torch.tensor(next(documents), dtype=torch.long)
            ids[r, start:start + length] = seq
            labels[r, start:start + length - 1] = seq[1:]
            loss_mask[r, start:start + length - 1] = 1.0  # a position has a label when the next token is real
            if masks is not None:
                loss_mask[r, start:start + length] *= torch.tensor(next(masks), dtype=loss_mask.dtype)
            positions[r, start:end] = torch.arange(end - start)
    return BatchTensors(tokens=ids, labels=labels, loss_mask=loss_mask, position_ids=positions)
