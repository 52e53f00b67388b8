"""SGLang's native /generate response with return_logprob (sglang 0.5.23, tokenizer_manager.py).

    {"output_ids": [...], "meta_info": {"prompt_tokens": 3,
      "input_token_logprobs": [[null, 1, null], [-7.12, 450, null], ...],   # with logprob_start_len=0
      "output_token_logprobs": [[-0.41, 310, null], ...]}, "prompt_token_ids"?: [...]}

Each entry is [logprob, token_id, text_or_null]; a batch request returns a list of them. The prompt
ids are the input_token_logprobs ids when they cover the whole prompt (logprob_start_len=0), else
the top-level prompt_token_ids (return_prompt_token_ids); entry 0 of input_token_logprobs is
always null. orjson writes -inf and NaN as null: a null past entry 0 reads as NaN (it fails).
"""

from __future__ import annotations

from typing import Any, Optional

from megalign.rollouts.sample import Sample, ids, logprob
from megalign.errors import UserError


def detect(item: dict) -> bool:
    meta = item.get("meta_info")
    return isinstance(meta, dict) and isinstance(meta.get("output_token_logprobs"), list)


def read(item: dict, where: str, hf: Any = None) -> list[Sample]:
    meta = item["meta_info"]
    output = _triples(meta["output_token_logprobs"], f"{where}: meta_info.output_token_logprobs")
    response = [token for _, token in output]
    if "output_ids" in item and ids(item["output_ids"], f"{where}: output_ids") != response:
        raise UserError(f"{where}: output_ids differ from the token ids of meta_info.output_token_logprobs")
    prompt, prompt_logprobs = _prompt(item, meta, where)
    return [Sample(prompt=prompt, response=response, response_logprobs=[value for value, _ in output],
                   prompt_logprobs=prompt_logprobs)]


def _prompt(item: dict, meta: dict, where: str) -> tuple[list[int], Optional[list[Optional[float]]]]:
    """The prompt ids, and their logprobs when input_token_logprobs covers the whole prompt."""
    given = ids(item["prompt_token_ids"], f"{where}: prompt_token_ids") if "prompt_token_ids" in item else None
    inputs = meta.get("input_token_logprobs")
    count = meta.get("prompt_tokens", len(given) if given is not None else None)
    if isinstance(inputs, list) and inputs and len(inputs) == count:
        triples = _triples(inputs, f"{where}: meta_info.input_token_logprobs", first_null=True)
        prompt = [token for _, token in triples]
        if given is not None and given != prompt:
            raise UserError(f"{where}: prompt_token_ids differ from the ids of meta_info.input_token_logprobs")
        return prompt, [None] + [value for value, _ in triples[1:]]
    if given is None:
        raise UserError(f"{where}: the prompt's token ids are not in the file: request logprob_start_len=0 or "
                        "return_prompt_token_ids=true")
    return given, None


def _triples(entries: Any, where: str, first_null: bool = False) -> list[tuple[Optional[float], int]]:
    result = []
    for i, entry in enumerate(entries if isinstance(entries, list) else [None]):
        if not (isinstance(entry, list) and len(entry) in (2, 3)):
            raise UserError(f"{where}[{i}]: expected [logprob, token_id, text_or_null]")
        token = ids([entry[1]], f"{where}[{i}][1]")[0]
        result.append((None if first_null and i == 0 else logprob(entry[0], f"{where}[{i}][0]"), token))
    return result
