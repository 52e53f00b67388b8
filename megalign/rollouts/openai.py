"""OpenAI-compatible responses with logprobs: completions and chat completions (openai-python's types;
vLLM's serving code for the token-id extensions).

    completions  {"choices": [{"logprobs": {"tokens": [...], "token_logprobs": [...]},
                   "prompt_token_ids"?: [...], "token_ids"?: [...], "prompt_logprobs"?: [...]}]}
    chat         {"prompt_token_ids"?: [...], "choices": [{"logprobs": {"content": [{"token": "Paris",
                   "logprob": -0.0012, "bytes": [80, 97, ...]}, ...]}, "token_ids"?: [...]}]}

Token ids come from the return_token_ids fields where present (vLLM's token_ids; SGLang's chat
names them response_token_ids), checked against the tokens' text under the --hf checkpoint's
tokenizer (vocabulary.check_spelling: another model's ids are refused), else from tokens spelled
"token_id:N" (return_tokens_as_token_ids), else each token's bytes (or its text) is looked up in the
--hf checkpoint's tokenizer. With echo the completions lists cover the prompt first, entry 0 null.
The prompt's ids must be in the file (vLLM's prompt_token_ids; for echo, usage.prompt_tokens splits
the lists, one prompt for every choice, n > 1 included): a chat template is not re-applied. Every
choice is a sample. A null field is an absent one (vLLM writes token_ids, prompt_token_ids,
prompt_logprobs and stop_reason null unless token ids were requested).

vLLM, SGLang, TensorRT-LLM and ollama spell a token by its decoded text (and its bytes from that
text): a token that ends inside a UTF-8 character arrives as U+FFFD, whose real bytes are lost.
Without ids such a choice cannot be mapped: it is left out, and said so (vocabulary.py).

Streamed (stream=true), the chunks (`merge`) carry each choice's tokens a few at a time, vLLM's
token_ids beside them, its prompt_token_ids once (the choice's, for completions; the chunk's, for
chat), and the usage in a last chunk without choices (stream_options.include_usage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from megalign.rollouts import vllm
from megalign.rollouts.sample import LeftOut, Sample, ids, logprob, same_length
from megalign.rollouts.vocabulary import Unmappable, check_spelling, token_ids
from megalign.errors import UserError

# Where a response has no prompt ids: what each engine is asked for (sglang 0.5.23's and vLLM 0.16's request fields)
ASK_COMPLETION_PROMPT = ("request return_token_ids=true (vLLM 0.10.2+ and SGLang: each choice's prompt_token_ids), or "
                         "echo=true with logprobs (vLLM: the prompt's tokens first, split at usage.prompt_tokens; one "
                         "prompt a request)")
ASK_CHAT_PROMPT = ("request return_token_ids=true (vLLM 0.10.2+: the response's prompt_token_ids; SGLang: each "
                   "choice's prompt_token_ids and response_token_ids), or on SGLang return_prompt_token_ids=true with "
                   "return_meta_info=true; or save the rollout as JSONL with prompt_ids")


def detect_completion(item: dict) -> bool:
    return _choices(item, lambda lp: "token_logprobs" in lp)


def detect_chat(item: dict) -> bool:
    return _choices(item, lambda lp: isinstance(lp.get("content"), list))


def _choices(item: dict, test) -> bool:
    choices = item.get("choices")
    return isinstance(choices, list) and bool(choices) and \
        all(isinstance(c, dict) and isinstance(c.get("logprobs"), dict) and test(c["logprobs"]) for c in choices)


def read_completion(item: dict, where: str, hf: Optional[Path] = None) -> list[Sample | LeftOut]:
    samples: list[Sample | LeftOut] = []
    echoed: Optional[list[int]] = None  # with echo, every choice echoes the one prompt
    for j, choice in enumerate(item["choices"]):
        at = f"{where}: choices[{j}]"
        lp = choice["logprobs"]
        values = [logprob(v, f"{at}.logprobs.token_logprobs[{i}]", null=None)
                  for i, v in enumerate(_list(lp["token_logprobs"], f"{at}.logprobs.token_logprobs"))]
        tokens = _list(lp.get("tokens"), f"{at}.logprobs.tokens")
        same_length(tokens, values, f"{at}.logprobs")
        prompt = _prompt(item, choice, at)
        if choice.get("token_ids") is not None:
            everything = ([] if prompt is None else prompt) + ids(choice["token_ids"], f"{at}.token_ids")
            everything = everything[len(everything) - len(values):] if len(values) <= len(everything) else None
            if everything is None:
                raise UserError(f"{at}: more logprobs than prompt and output token ids")
            check_spelling(everything, tokens, hf, f"{at}.token_ids")
        else:
            try:
                everything = token_ids([(t, None) for t in tokens], hf, f"{at}.logprobs.tokens")
            except Unmappable as e:
                samples.append(LeftOut(at, str(e)))
                continue
        echo = values and values[0] is None
        if prompt is None:
            count = (item.get("usage") or {}).get("prompt_tokens")
            if not (echo and isinstance(count, int) and 0 < count < len(everything)):
                raise UserError(f"{at}: the prompt's token ids are not in the file: {ASK_COMPLETION_PROMPT}")
            prompt = everything[:count]
            if echoed is not None and prompt != echoed:
                raise UserError(f"{at}: echoes another prompt than choices[0] (usage.prompt_tokens counts every "
                                "prompt of the request: send one prompt a request, or request return_token_ids)")
            echoed = prompt
        if echo:
            if everything[:len(prompt)] != prompt:
                raise UserError(f"{at}: the echoed tokens are not the prompt_token_ids")
            prompt_logprobs = values[:len(prompt)]
            everything, values = everything[len(prompt):], values[len(prompt):]
        else:
            prompt_logprobs = None
            if choice.get("prompt_logprobs") is not None:
                prompt_logprobs = [None] + vllm.per_token(choice["prompt_logprobs"], prompt,
                                                                  f"{at}.prompt_logprobs")[1:]
        samples.append(Sample(prompt=prompt, response=everything, response_logprobs=_numbers(values, at),
                              prompt_logprobs=prompt_logprobs))
    return samples


def read_chat(item: dict, where: str, hf: Optional[Path] = None) -> list[Sample | LeftOut]:
    samples: list[Sample | LeftOut] = []
    for j, choice in enumerate(item["choices"]):
        at = f"{where}: choices[{j}]"
        content = choice["logprobs"]["content"]
        if not all(isinstance(c, dict) and "token" in c and "logprob" in c for c in content):
            raise UserError(f"{at}.logprobs.content: expected {{token, logprob, bytes}} entries")
        values = [logprob(c["logprob"], f"{at}.logprobs.content[{i}].logprob") for i, c in enumerate(content)]
        prompt = _prompt(item, choice, at)
        if prompt is None:
            raise UserError(f"{at}: the prompt's token ids are not in the file (chat completions carry none): "
                            f"{ASK_CHAT_PROMPT}")
        named = next((name for name in ("token_ids", "response_token_ids") if choice.get(name) is not None), None)
        if named is not None:
            response = ids(choice[named], f"{at}.{named}")
            check_spelling(response, [c["token"] for c in content], hf, f"{at}.{named}")
        else:
            try:
                response = token_ids([(c["token"], c.get("bytes")) for c in content], hf, f"{at}.logprobs.content")
            except Unmappable as e:
                samples.append(LeftOut(at, str(e)))
                continue
        same_length(response, values, at)
        samples.append(Sample(prompt=prompt, response=response, response_logprobs=values))
    return samples


def _prompt(item: dict, choice: dict, at: str) -> Optional[list[int]]:
    for holder, name in ((choice, f"{at}.prompt_token_ids"), (item, "prompt_token_ids")):
        if holder.get("prompt_token_ids") is not None:
            return ids(holder["prompt_token_ids"], name)
    return None


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise UserError(f"{where}: expected a list")
    return value


def _numbers(values: list[Optional[float]], where: str) -> list[float]:
    if any(v is None for v in values):
        raise UserError(f"{where}: a generated token without a logprob (null)")
    return values


def merge(chunks: list[dict], where: str) -> dict:
    """An OpenAI-compatible stream's chunks (vLLM's, SGLang's) as the one response a request without
    stream returns: each choice's logprob lists and token ids joined in order."""
    merged = {k: v for k, v in chunks[0].items() if k != "choices"}
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for key in ("prompt_token_ids", "usage"):
            if chunk.get(key) is not None:
                merged[key] = chunk[key]
        for piece in chunk.get("choices") or []:
            if not isinstance(piece, dict):
                raise UserError(f"{where}: a chunk's choice that is not an object")
            into = choices.setdefault(piece.get("index", 0), {"index": piece.get("index", 0), "logprobs": {}})
            for key in ("prompt_token_ids", "prompt_logprobs", "finish_reason", "stop_reason"):
                if piece.get(key) is not None:
                    into[key] = piece[key]
            # a chunk without token ids makes the choice's unknown: a partial list would misplace them
            if "token_ids" in piece or "token_ids" in into:
                has = piece.get("token_ids") is not None and into.get("token_ids", []) is not None
                into["token_ids"] = into.get("token_ids", []) + piece["token_ids"] if has else None
            for key, value in (piece.get("logprobs") or {}).items():
                if isinstance(value, list):
                    into["logprobs"][key] = into["logprobs"].get(key, []) + value
    merged["choices"] = [choices[i] for i in sorted(choices)]
    return merged
