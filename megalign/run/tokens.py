"""Input tokens: reading and checking them, and the built-in default. The batch built from them is
stacks/batch.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import torch

from megalign.errors import UserError, is_int, read_user_text
from megalign.rollouts.read import read_rollout

# Two sequences of different lengths, so that padding and uneven CP token counts are exercised.
DEFAULT_LENGTHS = (32, 20)


def default_tokens(vocab_size: int, lengths=DEFAULT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def rollout_sequences(path: Path, hf: Optional[Path]) -> tuple[list[list[int]], list[list[int]]]:
    """--rollout's tokens (prompt + response) and label mask (the response) per sequence; `hf`: the
    checkpoint whose tokenizer maps a chat completion's string tokens to ids."""
    rollout = read_rollout(path, hf)
    for line in rollout.notes():  # what the run leaves out or compare will not judge, before it runs
        print(f"megalign: {line}", file=sys.stderr)
    return rollout.tokens(), rollout.label_masks()


def load_tokens(path: Path) -> list[list[int]]:
    """Read `[[ids...], ...]` or `{"tokens": [[ids...], ...]}` from a JSON file."""
    text = read_user_text(path, "tokens file")
    try:
        raw = json.loads(text)
    except RecursionError:
        raise UserError(f"tokens file {path} is nested too deeply; expected [[ids...], ...]") from None
    except json.JSONDecodeError as e:
        raise UserError(f"tokens file {path} is not valid JSON: {e}") from None
    if isinstance(raw, dict):
        raw = raw.get("tokens")
    if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        raw = [raw]
    if not (isinstance(raw, list) and raw and all(isinstance(s, list) and s for s in raw)
            and all(is_int(t) for s in raw for t in s)):
        raise UserError(f"tokens file {path} must hold a non-empty list of non-empty lists of integer token ids")
    return raw


def check_tokens(tokens: list[list[int]], vocab_size: int, fix: str = "") -> None:
    """`fix`: what to do about an id outside the vocabulary, said after it."""
    for i, seq in enumerate(tokens):
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"sequence {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size}){fix}")
    if all(len(seq) < 2 for seq in tokens):
        raise UserError("no sequence has two tokens: no position has a next token to predict, so there is no "
                        "loss and no gradient")


def resolve_seq_len(tokens: list[list[int]], seq_len: Optional[int]) -> int:
    longest = max(len(s) for s in tokens)
    if seq_len is None:
        return longest
    if seq_len < longest:
        raise UserError(f"--seq-len {seq_len} is shorter than the longest sequence ({longest} tokens)")
    return seq_len
