"""One rollout as megalign holds it, whatever engine wrote it: per sample, the prompt ids, the response
ids, the logprob of each response token (and of the prompt tokens where the file has them) and which
response tokens count (the loss mask); and the checks every format's reader makes of what it takes.

Positions follow the trainer's dump: position t of a sequence holds log P(token t+1 | tokens <= t),
so the logprob of token t sits at position t-1 (`Sample.at_positions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megalign.errors import UserError, is_int, is_number


@dataclass
class Sample:
    """One generated sequence. A logprob is NaN where the file has null past the first prompt token
    (orjson writes -inf and NaN as null); prompt_logprobs is None when the file has none, and
    response_logprobs None where the engine's were not kept (slime's `rollout_log_probs: null`: the
    trainer recomputes them): its tokens run, nothing of it is compared."""

    prompt: list[int]
    response: list[int]
    response_logprobs: Optional[list[float]]
    prompt_logprobs: Optional[list[Optional[float]]] = None  # entry 0 None: the first token has no context
    response_mask: Optional[list[int]] = None  # 0 on tokens the trainer leaves out (tool output); default all 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    def label_mask(self) -> list[int]:
        """Per position of prompt+response, 1 where the next token is a response token that counts."""
        mask = self.response_mask or [1] * len(self.response)
        return [0] * (len(self.prompt) - 1) + [int(bool(m)) for m in mask] + [0]

    def at_positions(self) -> tuple[list[float], list[int]]:
        """(logprob, compared) per position: the file's logprob of the next token, where it has one."""
        values = [0.0] * len(self.tokens)
        compared = [0] * len(self.tokens)
        prompt = self.prompt_logprobs or []
        for i, value in enumerate(prompt[1:], start=1):
            if value is not None:
                values[i - 1], compared[i - 1] = value, 1
        for j, (value, keep) in enumerate(zip(self.response_logprobs or [], self.label_mask()[len(self.prompt) - 1:])):
            if keep:
                values[len(self.prompt) + j - 1], compared[len(self.prompt) + j - 1] = value, 1
        return values, compared


@dataclass(frozen=True)
class LeftOut:
    """A sequence of the file that a reader cannot map to token ids without guessing."""

    where: str  # the file, item and choice
    why: str  # from the token that cannot be mapped on: "FILE: choices[1].logprobs.tokens[6]: ..."


@dataclass
class Rollout:
    path: Path
    format: str  # which engine's format, in words
    samples: list[Sample]
    left_out: list[LeftOut] = field(default_factory=list)

    def recompute_only(self) -> list[int]:
        """The samples without the engine's logprobs: run, never compared."""
        return [i for i, s in enumerate(self.samples) if s.response_logprobs is None]

    def notes(self) -> list[str]:
        """What of the file is not compared, and why, one line each (empty when all of it is)."""
        lines = [f"left out: {x.why}" for x in self.left_out]
        if self.recompute_only():
            lines.append(f"{len(self.recompute_only())} of {len(self.samples)} sequences have no engine logprobs "
                         "(rollout_log_probs null: recompute only): run, not compared")
        return lines

    def tokens(self) -> list[list[int]]:
        return [s.tokens for s in self.samples]

    def label_masks(self) -> list[list[int]]:
        return [s.label_mask() for s in self.samples]

    def response_tokens(self) -> int:
        """The response tokens that count (loss mask 1): what compare judges and backward's loss is over."""
        return sum(map(sum, self.label_masks()))


# The checks every reader makes of what it takes from a file: `where` names the file, item and field.

def ids(value: Any, where: str) -> list[int]:
    if not (isinstance(value, list) and all(is_int(t) and t >= 0 for t in value)):
        raise UserError(f"{where}: expected a list of token ids (integers >= 0)")
    return value


def logprob(value: Any, where: str, null: Optional[float] = math.nan) -> Optional[float]:
    """A logprob; null reads as `null` (NaN: orjson's -inf/NaN; None where the format means "none")."""
    if value is None:
        return null
    if not is_number(value):
        raise UserError(f"{where}: expected a number, found {type(value).__name__}")
    return float(value)


def same_length(a: list, b: list, where: str) -> None:
    if len(a) != len(b):
        raise UserError(f"{where}: {len(a)} token ids but {len(b)} logprobs")
