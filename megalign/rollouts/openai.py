"""OpenAI-compatible responses with logprobs: completions and chat completions (openai-python's types;
vLLM's serving code for the token-id extensions).

    completions  {"choices": [{"logprobs": {"tokens": [...], "token_logprobs": [...]},
                   "prompt_token_ids"?: [...], "token_ids"?: [...], "prompt_logprobs"?: [...]}]}
    chat         {"prompt_token_ids"?: [...], "choices": [{"logprobs": {"content": [{"token": "Paris",
                   "logprob": -0.0012, "bytes": [80, 97, ...]}, ...]}, "token_ids"?: [...]}]}

Token ids come from vLLM's return_token_ids fields where present, else from tokens spelled
"token_id:N" (return_tokens_as_token_ids), else each token's bytes (or its text) is looked up in the
--hf checkpoint's tokenizer. With echo the completions lists cover the prompt first, entry 0 null.
The prompt's ids must be in the file (vLLM's prompt_token_ids; for echo, usage.prompt_tokens splits
the lists, one prompt for every choice, n > 1 included): a chat template is not re-applied. Every
choice is a sample. A null field is an absent one (vLLM writes token_ids, prompt_token_ids,
prompt_logprobs and stop_reason null unless token ids were requested).

vLLM, SGLang, TensorRT-LLM and ollama spell a token by its decoded text (and its bytes from that
text): a token that ends inside a UTF-8 character arrives as U+FFFD (bytes 239,191,189), whose real
bytes are lost. Without ids such a choice cannot be mapped: it is left out, and said so.

Streamed (stream=true), the chunks (`merge`) carry each choice's tokens a few at a time, vLLM's
token_ids beside them, its prompt_token_ids once (the choice's, for completions; the chunk's, for
chat), and the usage in a last chunk without choices (stream_options.include_usage).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Optional

from megalign.rollouts import vllm
from megalign.rollouts.sample import LeftOut, Sample, ids, logprob, same_length
from megalign.errors import UserError

TOKEN_ID = re.compile(r"token_id:(\d+)")
REPLACEMENT = "\ufffd".encode("utf-8")  # 239, 191, 189


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
                raise UserError(f"{at}: the prompt's token ids are not in the file: request return_token_ids=true "
                                "(vLLM), or echo=true with usage (one prompt a request)")
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
                            "request return_token_ids=true (vLLM) or return_prompt_token_ids=true with "
                            "return_meta_info=true (SGLang), or save the rollout as JSONL with prompt_ids")
        if choice.get("token_ids") is not None:
            response = ids(choice["token_ids"], f"{at}.token_ids")
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


def token_ids(pieces: list[tuple[Any, Optional[list[int]]]], hf: Optional[Path], where: str) -> list[int]:
    """The id of each token: "token_id:N" as it says, else its bytes (or text) through the tokenizer."""
    spelled = [TOKEN_ID.fullmatch(t) if isinstance(t, str) else None for t, _ in pieces]
    if all(spelled):
        return [int(m.group(1)) for m in spelled]
    if hf is None:
        raise UserError(f"{where}: tokens are strings; pass --hf CHECKPOINT to map them to token ids through its "
                        "tokenizer (or request return_tokens_as_token_ids / return_token_ids from vLLM)")
    lookup = _vocabulary(hf)
    return [lookup.id_of(text, raw, f"{where}[{i}]") for i, (text, raw) in enumerate(pieces)]


class Unmappable(Exception):
    """A token whose id its spelling does not tell: its sequence is left out (LeftOut), never guessed."""


@functools.lru_cache(maxsize=2)  # loading a tokenizer takes a second: one per checkpoint and process
def _vocabulary(hf: Path) -> "_Vocabulary":
    return _Vocabulary(hf)


class _Vocabulary:
    """A tokenizer's token -> id map, with byte-level BPE's spelling of bytes (GPT-2's bytes_to_unicode),
    so that a token's exact bytes find its id without re-tokenising text."""

    def __init__(self, hf: Path):
        from transformers import AutoTokenizer
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(hf))
        except (OSError, ValueError) as e:
            raise UserError(f"--hf {hf}: no tokenizer there ({e})") from None
        self.vocab = self.tokenizer.get_vocab()
        self.spelling = bytes_to_unicode()

    def id_of(self, text: Any, raw: Optional[list[int]], where: str) -> int:
        data = bytes(raw) if isinstance(raw, list) else str(text).encode("utf-8")
        if REPLACEMENT in data:
            # the engine decoded a token that ends inside a UTF-8 character: its own bytes are lost, and
            # the tokenizer's own U+FFFD token (or any other) would be a guess
            raise Unmappable(f"{where}: token {text!r} is spelled with U+FFFD (bytes 239,191,189), the engine's "
                             "decoded text of a partial UTF-8 character, so its id is unknown: request token ids "
                             "(vLLM return_token_ids=true or return_tokens_as_token_ids=true; SGLang "
                             "return_meta_info=true)")
        spelled = "".join(self.spelling[b] for b in data)
        for candidate in (spelled, str(text)):
            if candidate in self.vocab:
                return self.vocab[candidate]
        alone = self.tokenizer.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False)
        if len(alone) != 1:
            raise UserError(f"{where}: token {text!r} is not one token of the --hf tokenizer (the rollout is "
                            "another model's, or --hf is not the engine's checkpoint)")
        return alone[0]


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
