"""SGLang's native /generate response with return_logprob (sglang 0.5, tokenizer_manager.py).

    {"output_ids": [...], "meta_info": {"prompt_tokens": 3,
      "input_token_logprobs": [[null, 1, null], [-7.12, 450, null], ...],   # with logprob_start_len=0
      "output_token_logprobs": [[-0.41, 310, null], ...]}, "prompt_token_ids"?: [...]}

Each entry is [logprob, token_id, text_or_null]; a batch request returns a list of them. The prompt
ids are the input_token_logprobs ids when they cover the whole prompt (logprob_start_len=0), else
the top-level prompt_token_ids (return_prompt_token_ids). By default (logprob_start_len -1)
input_token_logprobs holds one entry, the last prompt token: it is checked against the prompt ids.
Entry 0 of a whole prompt's input_token_logprobs is always null. orjson writes -inf and NaN as
null: a null past entry 0 reads as NaN (it fails). A null field is an absent one.

Streamed (stream=true), every chunk is such an object: by default each carries everything so far
(output_ids, output_token_logprobs: cumulative); with --incremental-streaming-output only what is
new. meta_info.completion_tokens, the count so far, tells them apart.
"""

from __future__ import annotations

from typing import Any, Optional

from megalign.rollouts.sample import Sample, ids, logprob
from megalign.rollouts.vocabulary import check_spelling
from megalign.errors import UserError

# Where the prompt's ids are missing: what /generate is asked for (sglang 0.5.23's GenerateReqInput fields)
ASK_PROMPT = ("request return_prompt_token_ids=true, or logprob_start_len=0 (the whole prompt in "
              "input_token_logprobs, with its logprobs)")


def detect(item: dict) -> bool:
    meta = item.get("meta_info")
    return isinstance(meta, dict) and isinstance(meta.get("output_token_logprobs"), list)


def read(item: dict, where: str, hf: Any = None, ask: str = ASK_PROMPT) -> list[Sample]:
    """`ask`: what to request where the prompt's ids are missing (the chat endpoint has other options)."""
    meta = item["meta_info"]
    output = _triples(meta["output_token_logprobs"], f"{where}: meta_info.output_token_logprobs")
    response = [token for _, token in output]
    # with return_text_in_logprobs (the chat endpoint's default) each entry spells its token
    check_spelling(response, [e[2] if len(e) == 3 else None for e in meta["output_token_logprobs"]], hf,
                   f"{where}: meta_info.output_token_logprobs")
    if item.get("output_ids") is not None and ids(item["output_ids"], f"{where}: output_ids") != response:
        raise UserError(f"{where}: output_ids differ from the token ids of meta_info.output_token_logprobs")
    prompt, prompt_logprobs = _prompt(item, meta, where, ask)
    return [Sample(prompt=prompt, response=response, response_logprobs=[value for value, _ in output],
                   prompt_logprobs=prompt_logprobs)]


def _prompt(item: dict, meta: dict, where: str, ask: str) -> tuple[list[int], Optional[list[Optional[float]]]]:
    """The prompt ids, and their logprobs when input_token_logprobs covers the whole prompt."""
    given = None if item.get("prompt_token_ids") is None else ids(item["prompt_token_ids"], f"{where}: prompt_token_ids")
    inputs = meta.get("input_token_logprobs") or []
    count = meta.get("prompt_tokens")
    count = len(given) if count is None and given is not None else count
    if inputs and len(inputs) == count:
        triples = _triples(inputs, f"{where}: meta_info.input_token_logprobs", first_null=True)
        prompt = [token for _, token in triples]
        if given is not None and given != prompt:
            raise UserError(f"{where}: prompt_token_ids differ from the ids of meta_info.input_token_logprobs")
        return prompt, [None] + [value for value, _ in triples[1:]]
    if given is None:
        raise UserError(f"{where}: the prompt's token ids are not in the file: {ask}")
    tail = [token for _, token in _triples(inputs, f"{where}: meta_info.input_token_logprobs", first_null=True)]
    if tail and given[-len(tail):] != tail:
        raise UserError(f"{where}: meta_info.input_token_logprobs ends with token ids {tail}, the prompt_token_ids "
                        f"with {given[-len(tail):]}: they are not the prompt SGLang ran")
    return given, None


def _triples(entries: Any, where: str, first_null: bool = False) -> list[tuple[Optional[float], int]]:
    result = []
    for i, entry in enumerate(entries if isinstance(entries, list) else [None]):
        if not (isinstance(entry, list) and len(entry) in (2, 3)):
            raise UserError(f"{where}[{i}]: expected [logprob, token_id, text_or_null]")
        token = ids([entry[1]], f"{where}[{i}][1]")[0]
        result.append((None if first_null and i == 0 else logprob(entry[0], f"{where}[{i}][0]"), token))
    return result


def merge(chunks: list[dict], where: str) -> dict:
    """A /generate stream's chunks as the one response a request without stream returns."""
    streamed = [c for c in chunks if detect(c)]
    if not streamed:
        raise UserError(f"{where}: no chunk of the stream has meta_info.output_token_logprobs (return_logprob=true?)")
    metas = [c["meta_info"] for c in streamed]
    last = dict(streamed[-1], meta_info=dict(metas[-1]))
    # the prompt's entries come once (incremental) or in every chunk alike (cumulative): the first suffices
    last["meta_info"]["input_token_logprobs"] = next((m["input_token_logprobs"] for m in metas
                                                      if m.get("input_token_logprobs")), None)
    if all(len(m["output_token_logprobs"]) == m.get("completion_tokens") for m in metas):
        return last  # cumulative: the last chunk holds everything
    last["meta_info"]["output_token_logprobs"] = [e for m in metas for e in m["output_token_logprobs"]]
    outputs = [c.get("output_ids") for c in streamed]
    last["output_ids"] = None if any(o is None for o in outputs) else [t for o in outputs for t in o]
    return last
