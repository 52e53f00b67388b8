"""Rollout files: what an inference engine wrote of the tokens it generated and their logprobs.

Every format (formats.py, each as the engine's own code writes it) is read into one `Rollout`
(sample.py). A file is JSON, JSON lines, an SSE stream as a client saves it (`data: {...}` lines, a
`data: [DONE]` after each response: the chunks are put back together by the format's `merge`), or
slime/miles' `--save-debug-rollout-data` `.pt` (torch.load with weights_only=True). It is recognised
by keys only one format has; anything else is one line and exit 2. Both sides read them: a run takes
its tokens and loss mask from one (--rollout), compare its logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from megalign.errors import UserError, read_user_text
from megalign.rollouts import slime
from megalign.rollouts.formats import FORMATS, RolloutFormat, described, detected
from megalign.rollouts.sample import LeftOut, Rollout, Sample

# A rollout file holds a whole RL step's samples, with prompt logprobs and top-k lists: hundreds of
# megabytes at most (1,000 samples of 16k tokens with their logprobs as JSON is about 300 MiB).
# Python's json holds it in about 5-10 times its size, so 512 MiB keeps that within a few GiB; a
# larger file is the wrong file, or one step that should be split.
MAX_ROLLOUT_FILE = 512 << 20
SUFFIXES = (".json", ".jsonl", ".sse")
SSE_DATA = "data:"
SSE_DONE = "[DONE]"


def is_rollout_file(path: Path) -> bool:
    """By its name, and for a `.pt` (also a plain tensor file's suffix) by what it holds; a folder
    never is, whatever its name (a dump folder called run.json)."""
    path = Path(path)
    if path.is_dir():
        return False
    if path.suffix.lower() == ".pt":
        return slime.is_debug_rollout(path)
    return path.suffix.lower() in SUFFIXES


def read_rollout(path: Path, hf: Optional[Path] = None) -> Rollout:
    """The samples of a rollout file; `hf`: the checkpoint whose tokenizer maps string tokens to ids."""
    path = Path(path)
    if path.suffix.lower() == ".pt":
        items = slime.load_debug_rollout(path)
        return _read_as(_format_of(items, path), items, path, hf)
    text = read_user_text(path, "rollout file", limit=MAX_ROLLOUT_FILE)
    streams = _streams(text, path)
    if streams is not None:
        return _read_stream(streams, path, hf)
    content = _parse(text, path)
    items = content if isinstance(content, list) else [content]
    return _read_as(_format_of(items, path), items, path, hf)


def _format_of(items: list, path: Path) -> RolloutFormat:
    first = items[0] if items else None
    found = detected(first)
    if found is None:
        raise UserError(f"{path}: not a rollout file megalign reads ({_found(first)}); expected {described()}")
    return found


def _read_stream(streams: list[list[dict]], path: Path, hf: Optional[Path]) -> Rollout:
    """Each response's chunks merged into the response the format's reader takes."""
    found = next((f for chunk in streams[0] for f in FORMATS if f.detect(chunk)), None)
    if found is None:
        raise UserError(f"{path}: an SSE stream whose chunks are of no rollout format megalign reads "
                        f"({_found(streams[0][0])}; logprobs requested?); expected {described()}")
    if found.merge is None:
        raise UserError(f"{path}: an SSE stream of {found.name} objects, which no engine streams")
    where = (lambda k: f"{path} stream {k}") if len(streams) > 1 else (lambda k: str(path))
    return _read_as(found, [found.merge(chunks, where(k)) for k, chunks in enumerate(streams)], path, hf)


def _read_as(found: RolloutFormat, items: list, path: Path, hf: Optional[Path]) -> Rollout:
    name = found.name
    if not all(isinstance(item, dict) and found.detect(item) for item in items):
        raise UserError(f"{path}: a {name} file whose items are not all {name} objects")
    try:
        read = [s for k, item in enumerate(items)
                for s in found.read(item, f"{path}" + (f" item {k}" if len(items) > 1 else ""), hf)]
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        # the readers check what they take; a field of a shape they do not expect is named by Python
        raise UserError(f"{path}: a {name} file with a field of another type or shape "
                        f"({type(e).__name__}: {e})") from None
    samples = [s for s in read if isinstance(s, Sample)]
    left_out = [s for s in read if isinstance(s, LeftOut)]
    if not samples:
        if left_out:
            raise UserError(left_out[0].why +
                            (f" (and {len(left_out) - 1} more sequences alike)" if len(left_out) > 1 else ""))
        raise UserError(f"{path}: a {name} file with no sample")
    if any(not sample.prompt for sample in samples):
        raise UserError(f"{path}: a sample with an empty prompt (its first token has no context to be "
                        "predicted from)")
    rollout = Rollout(path=path, format=name, samples=samples, left_out=left_out)
    if not rollout.response_tokens():
        raise UserError(f"{path}: no response token to compare ({len(samples)} samples, every response "
                        "empty or its loss_mask 0): the trainer's logprobs would be judged on nothing")
    return rollout


def _parse(text: str, path: Path) -> Any:
    """JSON, else JSON lines (one object a line)."""
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


def _streams(text: str, path: Path) -> Optional[list[list[dict]]]:
    """An SSE file's responses, each its list of chunks (a `[DONE]` ends one); None for a file that
    is not SSE. Lines other than `data:` (event:, id:, comments, blank) carry no chunk."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not (lines and lines[0].startswith(SSE_DATA)):
        return None
    streams: list[list[dict]] = [[]]
    for n, line in enumerate(lines, start=1):
        if not line.startswith(SSE_DATA):
            continue
        data = line[len(SSE_DATA):].strip()
        if data == SSE_DONE:
            streams.append([])
            continue
        try:
            chunk = json.loads(data)
        except (json.JSONDecodeError, RecursionError) as e:
            raise UserError(f"{path} line {n}: an SSE data line that is not JSON ({e})") from None
        if not isinstance(chunk, dict):
            raise UserError(f"{path} line {n}: an SSE chunk that is not an object")
        if "error" in chunk and "choices" not in chunk and "meta_info" not in chunk:
            raise UserError(f"{path} line {n}: the engine streamed an error: {str(chunk['error'])[:200]}")
        streams[-1].append(chunk)
    streams = [s for s in streams if s]
    if not streams:
        raise UserError(f"{path}: an SSE stream with no chunk")
    return streams


def _found(first: Any) -> str:
    if isinstance(first, dict):
        keys = ", ".join(sorted(map(str, first))[:8])
        return f"found an object with keys {keys}" if keys else "found an empty object"
    return f"found {type(first).__name__ if first is not None else 'null'}"
