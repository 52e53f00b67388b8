"""The rollout formats megalign reads, listed once: read.py tries them in this order, and `--rollout`'s
help and the error for a file of none of them name them from here (`described`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megalign.rollouts import jsonl, openai, sglang, vllm
from megalign.rollouts.sample import Sample


@dataclass(frozen=True)
class RolloutFormat:
    name: str  # in words: the report's "rollout: NAME" and the reader's errors
    detect: Callable[[dict], bool]  # by keys only this format has
    read: Callable[..., list[Sample]]  # (item, where, hf) -> the item's samples


FORMATS = (
    RolloutFormat("SGLang /generate", sglang.detect, sglang.read),
    RolloutFormat("vLLM offline RequestOutput", vllm.detect, vllm.read),
    RolloutFormat("OpenAI-compatible completions", openai.detect_completion, openai.read_completion),
    RolloutFormat("OpenAI-compatible chat completions", openai.detect_chat, openai.read_chat),
    RolloutFormat("JSONL prompt_ids/response_ids/response_logprobs", jsonl.detect, jsonl.read),
    RolloutFormat("slime/miles Sample dicts", jsonl.detect_slime, jsonl.read_slime),
)


def described() -> str:
    """Every format's name, for a sentence: `A, B or C`."""
    names = [f.name for f in FORMATS]
    return ", ".join(names[:-1]) + f" or {names[-1]}"


def detected(item: Any) -> RolloutFormat | None:
    """The format whose keys `item` (a file's first object) has; None for none."""
    return next((f for f in FORMATS if isinstance(item, dict) and f.detect(item)), None)
