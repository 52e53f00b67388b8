"""megalign's own rollout lines, one sample a line (JSON lines, or one JSON list of them):

    {"prompt_ids": [...], "response_ids": [...], "response_logprobs": [...], "loss_mask"?: [...]}

loss_mask, one per response token, is 0 on tokens the trainer leaves out (tool output, where slime
writes a 0.0 placeholder logprob). `sample_of` is shared with slime.py.
"""

from __future__ import annotations

from typing import Any, Optional

from megalign.rollouts.sample import Sample, ids, logprob, same_length
from megalign.errors import UserError


def detect(item: dict) -> bool:
    return {"prompt_ids", "response_ids", "response_logprobs"} <= item.keys()


def read(item: dict, where: str, hf: Any = None) -> list[Sample]:
    response = ids(item["response_ids"], f"{where}: response_ids")
    return [sample_of(ids(item["prompt_ids"], f"{where}: prompt_ids"), response, item["response_logprobs"],
                    item.get("loss_mask"), where)]


def sample_of(prompt: list[int], response: list[int], values: Any, mask: Optional[Any], where: str) -> Sample:
    """`values` None: the engine's logprobs were not kept (recompute only)."""
    if values is not None and not isinstance(values, list):
        raise UserError(f"{where}: the response logprobs must be a list")
    if values is not None:
        same_length(response, values, where)
    if mask is not None and not (isinstance(mask, list) and len(mask) == len(response)
                                 and all(m in (0, 1) for m in mask)):
        raise UserError(f"{where}: loss_mask must hold one 0 or 1 per response token")
    return Sample(prompt=prompt, response=response,
                  response_logprobs=None if values is None else
                  [logprob(v, f"{where}: logprob {i}") for i, v in enumerate(values)],
                  response_mask=mask)
