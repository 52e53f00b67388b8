"""Input tokens: reading them, the built-in default, and the padded batch every layout sees.

The batch is built on the full sequence before any CP split, so that labels (the next token at each
global position) and the loss mask are the same for every layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megalign.alignment.errors import UserError

# Two sequences of different lengths, so that padding and uneven CP token counts are exercised.
DEFAULT_LENGTHS = (32, 20)


def default_tokens(vocab_size: int, lengths=DEFAULT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def load_tokens(path: Path) -> list[list[int]]:
    """Read `[[ids...], ...]` or `{"tokens": [[ids...], ...]}` from a JSON file."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"tokens file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"tokens file {path} is not valid JSON: {e}") from None
    if isinstance(raw, dict):
        raw = raw.get("tokens")
    if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        raw = [raw]
    if not (isinstance(raw, list) and raw and all(isinstance(s, list) and s for s in raw)
            and all(isinstance(t, int) and not isinstance(t, bool) for s in raw for t in s)):
        raise UserError(f"tokens file {path} must hold a non-empty list of non-empty lists of integer token ids")
    return raw


def check_tokens(tokens: list[list[int]], vocab_size: int) -> None:
    for i, seq in enumerate(tokens):
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"sequence {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")


def resolve_seq_len(tokens: list[list[int]], seq_len: Optional[int]) -> int:
    longest = max(len(s) for s in tokens)
    if seq_len is None:
        return longest
    if seq_len < longest:
        raise UserError(f"--seq-len {seq_len} is shorter than the longest sequence ({longest} tokens)")
    return seq_len


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
