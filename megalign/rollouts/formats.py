"""The rollout formats megalign reads, listed once: read.py tries them in this order, and `--rollout`'s
help and the error for a file of none of them name them from here (`described`). A new format is a
module (detect, read, and merge where its engine streams it) and a row here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from megalign.rollouts import jsonl, openai, sglang, sglang_chat, slime, vllm
from megalign.rollouts.sample import LeftOut, Sample


@dataclass(frozen=True)
class RolloutFormat:
    name: str  # in words: the report's "rollout: NAME" and the reader's errors
    detect: Callable[[dict], bool]  # by keys only this format has (a stream: any one of its chunks)
    read: Callable[..., list[Union[Sample, LeftOut]]]  # (item, where, hf) -> the item's samples
    # (chunks, where) -> the one response an SSE stream's chunks make; None: the engine does not stream it
    merge: Optional[Callable[[list[dict], str], dict]] = None


FORMATS = (
    RolloutFormat("SGLang /generate", sglang.detect, sglang.read, sglang.merge),
    RolloutFormat("SGLang chat completions with meta_info", sglang_chat.detect, sglang_chat.read),
    RolloutFormat("vLLM offline RequestOutput", vllm.detect, vllm.read),
    RolloutFormat("OpenAI-compatible completions", openai.detect_completion, openai.read_completion, openai.merge),
    RolloutFormat("OpenAI-compatible chat completions", openai.detect_chat, openai.read_chat, openai.merge),
    RolloutFormat("JSONL prompt_ids/response_ids/response_logprobs", jsonl.detect, jsonl.read),
    RolloutFormat("slime/miles Sample dicts (JSON lines or --save-debug-rollout-data .pt)", slime.detect, slime.read),
)


def described() -> str:
    """Every format's name, for a sentence: `A, B or C`."""
    names = [f.name for f in FORMATS]
    return ", ".join(names[:-1]) + f" or {names[-1]}"


def detected(item: Any) -> Optional[RolloutFormat]:
    """The format whose keys `item` (a file's first object) has; None for none."""
    return next((f for f in FORMATS if isinstance(item, dict) and f.detect(item)), None)
