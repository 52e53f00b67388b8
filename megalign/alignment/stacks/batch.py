"""What every stack runs on: the padded batch, and how its token losses become the loss.

The batch is built on the full sequence before any CP split, so that labels (the next token at each
global position) and the loss mask are the same for every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def mean_token_loss(per_token: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The masked token losses summed and divided by `count` valid tokens: every stack's normalisation."""
    return (per_token.float() * mask).sum() / count.clamp(min=1)


@dataclass
class Batch:
    """[batch, seq] tensors: tokens, next-token labels, loss mask (0 on padding and last token), positions."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens, "labels": self.labels, "loss_mask": self.loss_mask,
                "position_ids": self.position_ids}


def build_batch(tokens: list[list[int]], seq_len: int) -> Batch:
    """Right-pad with token 0. Causal attention keeps real tokens from seeing the padding."""
    b = len(tokens)
    ids = torch.zeros(b, seq_len, dtype=torch.long)
    valid = torch.zeros(b, seq_len, dtype=torch.bool)
    for i, seq in enumerate(tokens):
        ids[i, : len(seq)] = torch.tensor(seq)
        valid[i, : len(seq)] = True
    labels = torch.roll(ids, shifts=-1, dims=1)
    # A position has a label when the next token is real.
    loss_mask = torch.roll(valid, shifts=-1, dims=1) & valid
    loss_mask[:, -1] = False
    positions = torch.arange(seq_len).unsqueeze(0).expand(b, -1).contiguous()
    return Batch(tokens=ids, labels=labels, loss_mask=loss_mask.float(), position_ids=positions)
