"""Rollouts as RL trainers save them, one sample a line (JSON lines, or one JSON list of them).

    megalign  {"prompt_ids": [...], "response_ids": [...], "response_logprobs": [...], "loss_mask"?: [...]}
    slime     {"tokens": prompt+response, "response_length": N, "rollout_log_probs": [...], "loss_mask"?: [...]}

(slime/miles' Sample.to_dict, slime/utils/types.py.) loss_mask, one per response token, is 0 on
tokens the trainer leaves out (tool output, where slime writes a 0.0 placeholder logprob).
"""

from __future__ import annotations

from typing import Any, Optional

from megalign.rollouts.sample import Sample, ids, logprob, same_length
from megalign.errors import UserError


def detect(item: dict) -> bool:
    return {"prompt_ids", "response_ids", "response_logprobs"} <= item.keys()


def detect_slime(item: dict) -> bool:
    return {"tokens", "response_length", "rollout_log_probs"} <= item.keys()


def read(item: dict, where: str, hf: Any = None) -> list[Sample]:
    response = ids(item["response_ids"], f"{where}: response_ids")
    return [_sample(ids(item["prompt_ids"], f"{where}: prompt_ids"), response, item["response_logprobs"],
                    item.get("loss_mask"), where)]


def read_slime(item: dict, where: str, hf: Any = None) -> list[Sample]:
    tokens, length = ids(item["tokens"], f"{where}: tokens"), item["response_length"]
    if not (isinstance(length, int) and 0 < length < len(tokens)):
        raise UserError(f"{where}: response_length must be between 1 and the token count - 1, got {length!r}")
    return [_sample(tokens[:-length], tokens[-length:], item["rollout_log_probs"], item.get("loss_mask"), where)]


def _sample(prompt: list[int], response: list[int], values: Any, mask: Optional[Any], where: str) -> Sample:
    if not isinstance(values, list):
        raise UserError(f"{where}: the response logprobs must be a list")
    same_length(response, values, where)
    if mask is not None and not (isinstance(mask, list) and len(mask) == len(response)
                                 and all(m in (0, 1) for m in mask)):
        raise UserError(f"{where}: loss_mask must hold one 0 or 1 per response token")
    return Sample(prompt=prompt, response=response,
                  response_logprobs=[logprob(v, f"{where}: logprob {i}") for i, v in enumerate(values)],
                  response_mask=mask)
