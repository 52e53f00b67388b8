"""Rollout files: what an inference engine wrote of the tokens it generated and their logprobs.

Every format (formats.py: sglang.py, vllm.py, openai.py, jsonl.py, each as the engine's own code
writes it) is read into one `Rollout` (sample.py). A file is recognised by keys only one format has;
anything else is one line and exit 2. Both sides read them: a run takes its tokens and loss mask
from one (--rollout), compare its logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from megalign.errors import UserError, read_user_text
from megalign.rollouts.formats import RolloutFormat, described, detected
from megalign.rollouts.sample import Rollout

# A rollout file holds a whole RL step's samples, with prompt logprobs and top-k lists: hundreds of
# megabytes at most (1,000 samples of 16k tokens with their logprobs as JSON is about 300 MiB).
# Python's json holds it in about 5-10 times its size, so 512 MiB keeps that within a few GiB; a
# larger file is the wrong file, or one step that should be split.
MAX_ROLLOUT_FILE = 512 << 20
SUFFIXES = (".json", ".jsonl")


def is_rollout_file(path: Path) -> bool:
    """By its name; a folder never is, whatever its name (a dump folder called run.json)."""
    return path.suffix.lower() in SUFFIXES and not path.is_dir()


def read_rollout(path: Path, hf: Optional[Path] = None) -> Rollout:
    """The samples of a rollout file; `hf`: the checkpoint whose tokenizer maps string tokens to ids."""
    content = _parse(path)
    first = content[0] if isinstance(content, list) and content else content
    found = detected(first)
    if found is None:
        raise UserError(f"{path}: not a rollout file megalign reads ({_found(first)}); expected {described()}")
    return _read_as(found, content if isinstance(content, list) else [content], path, hf)


def _read_as(found: RolloutFormat, items: list, path: Path, hf: Optional[Path]) -> Rollout:
    name = found.name
    if not all(isinstance(item, dict) and found.detect(item) for item in items):
        raise UserError(f"{path}: a {name} file whose items are not all {name} objects")
    try:
        samples = [s for k, item in enumerate(items)
                   for s in found.read(item, f"{path}" + (f" item {k}" if len(items) > 1 else ""), hf)]
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
