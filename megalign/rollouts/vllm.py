"""vLLM's offline outputs (LLM.generate -> RequestOutput) saved as JSON, vllm/outputs.py and logprobs.py.

    {"prompt_token_ids": [...], "prompt_logprobs": [null, {"450": {"logprob": -7.12, "rank": 311,
      "decoded_token": "The"}, ...}, ...], "outputs": [{"token_ids": [...], "logprobs": [{"310": {...}}, ...]}]}

Each position's dict holds the actual token and the top-k, keyed by token id (a string once in
JSON): the value is looked up by the actual token's id, never taken as the first key. With
flat_logprobs the list is a FlatLogprobs object (start_indices, end_indices, token_ids, logprobs).
Every one of `outputs` (n > 1) is a sample of its own over the same prompt. Entry 0 of
prompt_logprobs is null (the first token has no context).
"""

from __future__ import annotations

from typing import Any, Optional

from megalign.rollouts.sample import Sample, ids, logprob, same_length
from megalign.errors import UserError


def detect(item: dict) -> bool:
    outputs = item.get("outputs")
    return "prompt_token_ids" in item and isinstance(outputs, list) and bool(outputs) and \
        all(isinstance(o, dict) and "token_ids" in o and "logprobs" in o for o in outputs)


def read(item: dict, where: str, hf: Any = None) -> list[Sample]:
    prompt = ids(item["prompt_token_ids"], f"{where}: prompt_token_ids")
    prompt_logprobs = None
    if item.get("prompt_logprobs") is not None:
        prompt_logprobs = [None] + per_token(item["prompt_logprobs"], prompt, f"{where}: prompt_logprobs")[1:]
    samples = []
    for j, output in enumerate(item["outputs"]):
        at = f"{where}: outputs[{j}]"
        response = ids(output["token_ids"], f"{at}.token_ids")
        if output["logprobs"] is None:
            raise UserError(f"{at}.logprobs is null: generate with SamplingParams(logprobs=0) or more")
        values = per_token(output["logprobs"], response, f"{at}.logprobs")
        samples.append(Sample(prompt=prompt, response=response, response_logprobs=values,
                              prompt_logprobs=prompt_logprobs))
    return samples


def per_token(entries: Any, tokens: list[int], where: str) -> list[Optional[float]]:
    """The logprob of each of `tokens` from vLLM's per-position dicts (or a FlatLogprobs object)."""
    if isinstance(entries, dict) and "start_indices" in entries:
        entries = _unflatten(entries, where)
    if not isinstance(entries, list):
        raise UserError(f"{where}: expected a list of per-token dicts")
    same_length(tokens, entries, where)
    values: list[Optional[float]] = []
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        if entry is None:
            values.append(None)
            continue
        found = entry.get(str(token), entry.get(token)) if isinstance(entry, dict) else None
        if found is None:
            raise UserError(f"{where}[{i}]: no logprob for token {token}, the token at that position")
        values.append(logprob(found.get("logprob") if isinstance(found, dict) else found, f"{where}[{i}]"))
    return values


def _unflatten(flat: dict, where: str) -> list[dict]:
    try:
        return [{str(t): {"logprob": v} for t, v in zip(flat["token_ids"][start:end], flat["logprobs"][start:end])}
                for start, end in zip(flat["start_indices"], flat["end_indices"])]
    except (KeyError, TypeError) as e:
        raise UserError(f"{where}: a FlatLogprobs object without {e}") from None
