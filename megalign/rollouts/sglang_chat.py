"""SGLang's OpenAI-compatible chat completions with its extensions, the form agentic RL rollouts use
(slime's and miles' sessions read choices[i].meta_info.output_token_logprobs): a request with
logprobs=true, return_meta_info=true and return_prompt_token_ids=true (sglang 0.5,
entrypoints/openai/serving_chat.py; both are refused with stream=true).

    {"choices": [{"index": 0, "message": {...}, "logprobs": {"content": [...]}, "finish_reason": "stop",
      "matched_stop": null, "hidden_states": null, "prompt_token_ids": [...], "response_token_ids"?: [...],
      "meta_info": {"prompt_tokens": 12, "input_token_logprobs": [[null, 7, "..."]],
                    "output_token_logprobs": [[-0.41, 310, "Paris"], ...], ...}}], "usage": {...}}

Each choice's meta_info is /generate's (sglang.py reads it), its prompt ids the choice's own.
"""

from __future__ import annotations

from typing import Any

from megalign.rollouts import sglang
from megalign.rollouts.sample import Sample

# sglang 0.5.23's chat request fields for the prompt's ids (its chat runs with logprob_start_len -1, fixed)
ASK_PROMPT = "request return_prompt_token_ids=true (or return_token_ids=true) with return_meta_info=true"


def detect(item: dict) -> bool:
    choices = item.get("choices")
    return isinstance(choices, list) and bool(choices) and \
        all(isinstance(c, dict) and sglang.detect(c) for c in choices)


def read(item: dict, where: str, hf: Any = None) -> list[Sample]:
    return [sample for j, choice in enumerate(item["choices"])
            for sample in sglang.read({"meta_info": choice["meta_info"], "output_ids": choice.get("response_token_ids"),
                                       "prompt_token_ids": choice.get("prompt_token_ids")}, f"{where}: choices[{j}]",
                                      hf, ASK_PROMPT)]
