"""Rollout files: what an inference engine wrote of the tokens it generated and their logprobs.

Every format (rollout_sglang.py, rollout_vllm.py, rollout_openai.py, rollout_jsonl.py, each as the
engine's own code writes it) is read into one `Rollout`: per sample, the prompt ids, the response
ids, the logprob of each response token (and of the prompt tokens where the file has them) and
which response tokens count (the loss mask). A file is recognised by keys only one format has;
anything else is one line and exit 2.

Positions follow the trainer's dump: position t of a sequence holds log P(token t+1 | tokens <= t),
so the logprob of token t sits at position t-1 (`Sample.at_positions`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megalign.errors import UserError, read_user_text

# A rollout file holds a whole RL step's samples, with prompt logprobs and top-k lists: hundreds of
# megabytes at most (1,000 samples of 16k tokens with their logprobs as JSON is about 300 MiB).
# Python's json holds it in about 5-10 times its size, so 512 MiB keeps that within a few GiB; a
# larger file is the wrong file, or one step that should be split.
MAX_ROLLOUT_FILE = 512 << 20
SUFFIXES = (".json", ".jsonl")


@dataclass
class Sample:
    """One generated sequence. A logprob is NaN where the file has null past the first prompt token
    (orjson writes -inf and NaN as null); prompt_logprobs is None when the file has none."""

    prompt: list[int]
    response: list[int]
    response_logprobs: list[float]
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
        for j, (value, keep) in enumerate(zip(self.response_logprobs, self.label_mask()[len(self.prompt) - 1:])):
            if keep:
                values[len(self.prompt) + j - 1], compared[len(self.prompt) + j - 1] = value, 1
        return values, compared


@dataclass
class Rollout:
    path: Path
    format: str  # which engine's format, in words
    samples: list[Sample]

    def tokens(self) -> list[list[int]]:
        return [s.tokens for s in self.samples]

    def label_masks(self) -> list[list[int]]:
        return [s.label_mask() for s in self.samples]

    def response_tokens(self) -> int:
        """The response tokens that count (loss mask 1): what compare judges and backward's loss is over."""
        return sum(map(sum, self.label_masks()))

    def grid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """[sequence, position] tensors, right-padded: tokens, logprobs (float64), the positions
        compared (the file has a logprob), and the response positions that count (the loss mask)."""
        width = max(len(s.tokens) for s in self.samples)
        tokens = torch.zeros(len(self.samples), width, dtype=torch.long)
        logprobs = torch.zeros(len(self.samples), width, dtype=torch.float64)
        compared = torch.zeros(len(self.samples), width)
        loss_mask = torch.zeros(len(self.samples), width)
        for i, sample in enumerate(self.samples):
            values, keep = sample.at_positions()
            n = len(sample.tokens)
            tokens[i, :n] = torch.tensor(sample.tokens)
            logprobs[i, :n] = torch.tensor(values, dtype=torch.float64)
            compared[i, :n] = torch.tensor(keep, dtype=torch.float32)
            loss_mask[i, :n] = torch.tensor(sample.label_mask(), dtype=torch.float32)
        return tokens, logprobs, compared, loss_mask


def is_rollout_file(path: Path) -> bool:
    """By its name; a folder never is, whatever its name (a dump folder called run.json)."""
    return path.suffix.lower() in SUFFIXES and not path.is_dir()


def read_rollout(path: Path, hf: Optional[Path] = None) -> Rollout:
    """The samples of a rollout file; `hf`: the checkpoint whose tokenizer maps string tokens to ids."""
    from megalign.compare.sources import rollout_jsonl, rollout_openai, rollout_sglang, rollout_vllm

    content = _parse(path)
    first = content[0] if isinstance(content, list) and content else content
    readers: list[tuple[Callable[[Any], bool], Callable[..., list[Sample]], str]] = [
        (rollout_sglang.detect, rollout_sglang.read, "SGLang /generate"),
        (rollout_vllm.detect, rollout_vllm.read, "vLLM offline RequestOutput"),
        (rollout_openai.detect_completion, rollout_openai.read_completion, "OpenAI-compatible completions"),
        (rollout_openai.detect_chat, rollout_openai.read_chat, "OpenAI-compatible chat completions"),
        (rollout_jsonl.detect, rollout_jsonl.read, "JSONL prompt_ids/response_ids/response_logprobs"),
        (rollout_jsonl.detect_slime, rollout_jsonl.read_slime, "slime/miles Sample dicts"),
    ]
    for detect, read, name in readers:
        if isinstance(first, dict) and detect(first):
            items = content if isinstance(content, list) else [content]
            if not all(isinstance(item, dict) and detect(item) for item in items):
                raise UserError(f"{path}: a {name} file whose items are not all {name} objects")
            try:
                samples = [s for k, item in enumerate(items)
                           for s in read(item, f"{path}" + (f" item {k}" if len(items) > 1 else ""), hf)]
            except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
                # the readers check what they take; a field of a shape they do not expect is named by Python
                raise UserError(f"{path}: a {name} file with a field of another type or shape "
                                f"({type(e).__name__}: {e})") from None
            if not samples:
                raise UserError(f"{path}: a {name} file with no sample")
            if any(not sample.prompt for sample in samples):
                raise UserError(f"{path}: a sample with an empty prompt (its first token has no context to be "
                                "predicted from)")
            rollout = Rollout(path=path, format=name, samples=samples)
            if not rollout.response_tokens():
                raise UserError(f"{path}: no response token to compare ({len(samples)} samples, every response "
                                "empty or its loss_mask 0): the trainer's logprobs would be judged on nothing")
            return rollout
    raise UserError(f"{path}: not a rollout file megalign reads ({_found(first)}); expected SGLang /generate, "
                    "vLLM, OpenAI-compatible completions or chat with logprobs, or JSONL with prompt_ids, "
                    "response_ids and response_logprobs")


def _parse(path: Path) -> Any:
    """JSON, else JSON lines (one object a line)."""
    text = read_user_text(path, "rollout file", limit=MAX_ROLLOUT_FILE)
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"{path}: nested too deeply for a rollout file") from None
    except json.JSONDecodeError as whole:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) < 2:
            raise UserError(f"{path}: not JSON ({whole})") from None
        try:
            return [json.loads(line) for line in lines]
        except (json.JSONDecodeError, RecursionError) as e:
            raise UserError(f"{path}: neither JSON nor JSON lines ({e})") from None


def _found(first: Any) -> str:
    if isinstance(first, dict):
        keys = ", ".join(sorted(map(str, first))[:8])
        return f"found an object with keys {keys}" if keys else "found an empty object"
    return f"found {type(first).__name__ if first is not None else 'null'}"


# The checks every reader makes of what it takes from a file: `where` names the file, item and field.

def ids(value: Any, where: str) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                            for t in value)):
        raise UserError(f"{where}: expected a list of token ids (integers >= 0)")
    return value


def logprob(value: Any, where: str, null: Optional[float] = math.nan) -> Optional[float]:
    """A logprob; null reads as `null` (NaN: orjson's -inf/NaN; None where the format means "none")."""
    if value is None:
        return null
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: expected a number, found {type(value).__name__}")
    return float(value)


def same_length(a: list, b: list, where: str) -> None:
    if len(a) != len(b):
        raise UserError(f"{where}: {len(a)} token ids but {len(b)} logprobs")
