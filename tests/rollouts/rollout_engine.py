"""The live engine of the rollout tests: transformers' `generate` on the real SmolLM2 checkpoint, with
its KV cache (prefill, then one token a step: not a full-sequence forward), sampling at T = 0.7.
One generation is written in every format megalign reads, each as its engine writes it
(/work/notes/rollout-formats.md): SGLang /generate, vLLM offline, vLLM completions (echo with
"token_id:N" tokens; return_token_ids with text tokens), chat completions (text tokens and bytes),
megalign's JSONL and slime's.

The raw logprobs are log softmax of generate's raw logits (output_logits); the temperature-scaled
ones, log softmax of its processed scores (output_scores: logits / 0.7), are what SGLang returns for
output tokens at T = 0.7.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

PROMPTS = ("The capital of France is", "Once upon a time, in a small village,")
NEW_TOKENS = 16
TEMPERATURE = 0.7
UFFFD_AT = [(0, 13), (1, 14)]  # (sample, response token): the twin's ids read from "\ufffd" bytes, late
# enough that the tokens before them (whose context they are not in) are most of the 32


@dataclass
class Generated:
    prompt: list[int]
    response: list[int]
    raw: list[float]  # log softmax(logits)[token], per response token
    scaled: list[float]  # log softmax(logits / T)[token]
    prompt_logprobs: list  # [None, log P(p1 | p0), ...]: the engine's prefill


def generate(checkpoint: Path, eps_layer: Optional[int] = None) -> tuple[list[Generated], object]:
    """`eps_layer`: the planted engine bug, that layer's input norm epsilon 1e-6 instead of the model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if eps_layer is not None:
        model.model.layers[eps_layer].input_layernorm.variance_epsilon = 1e-6
    torch.manual_seed(0)
    samples = []
    with torch.no_grad():
        for text in PROMPTS:
            prompt = tokenizer(text, return_tensors="pt")["input_ids"]
            out = model.generate(prompt, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                 max_new_tokens=NEW_TOKENS, output_scores=True, output_logits=True,
                                 return_dict_in_generate=True, use_cache=True, pad_token_id=tokenizer.eos_token_id)
            response = out.sequences[0, prompt.shape[1]:].tolist()
            raw = [float(torch.log_softmax(l[0], -1)[t]) for l, t in zip(out.logits, response)]
            scaled = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, response)]
            prefill = torch.log_softmax(model(prompt).logits[0], -1)
            prompt_ids = prompt[0].tolist()
            prompt_logprobs = [None] + [float(prefill[i - 1, t]) for i, t in enumerate(prompt_ids) if i > 0]
            samples.append(Generated(prompt_ids, response, raw, scaled, prompt_logprobs))
    return samples, tokenizer


def sglang(samples: list[Generated], scaled: bool = False) -> list:
    """A batch /generate with return_logprob and logprob_start_len=0 (SGLang: raw prompt logprobs,
    output logprobs at the sampling temperature)."""
    return [{"text": "", "output_ids": s.response,
             "meta_info": {"id": f"req{i}", "finish_reason": {"type": "length", "length": len(s.response)},
                           "prompt_tokens": len(s.prompt), "weight_version": "default",
                           "input_token_logprobs": [[lp, t, None] for lp, t in zip(s.prompt_logprobs, s.prompt)],
                           "output_token_logprobs": [[lp, t, None] for lp, t in
                                                     zip(s.scaled if scaled else s.raw, s.response)],
                           "completion_tokens": len(s.response), "cached_tokens": 0}}
            for i, s in enumerate(samples)]


def _vllm_dicts(tokens: list[int], values: list, tokenizer) -> list:
    """vLLM's per-position {token_id: Logprob} dicts, a decoy first (the top-1 of another token id)."""
    return [None if v is None else
            {str((t + 1) % 1000): {"logprob": -0.5, "rank": 1, "decoded_token": "x"},
             str(t): {"logprob": v, "rank": 2, "decoded_token": tokenizer.decode([t])}}
            for t, v in zip(tokens, values)]


def vllm_offline(samples: list[Generated], tokenizer) -> list:
    return [{"request_id": str(i), "prompt": PROMPTS[i], "prompt_token_ids": s.prompt,
             "prompt_logprobs": _vllm_dicts(s.prompt, s.prompt_logprobs, tokenizer),
             "outputs": [{"index": 0, "text": tokenizer.decode(s.response), "token_ids": s.response,
                          "cumulative_logprob": sum(s.raw), "logprobs": _vllm_dicts(s.response, s.raw, tokenizer),
                          "finish_reason": "length", "stop_reason": None}], "finished": True}
            for i, s in enumerate(samples)]


def completions_echo_token_ids(s: Generated) -> dict:
    """/v1/completions with echo=true and return_tokens_as_token_ids=true: the prompt's tokens first."""
    tokens = s.prompt + s.response
    return {"id": "cmpl-0", "object": "text_completion", "model": "smollm2",
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "stop_reason": None,
                         "logprobs": {"text_offset": list(range(len(tokens))),
                                      "token_logprobs": s.prompt_logprobs + s.raw,
                                      "tokens": [f"token_id:{t}" for t in tokens],
                                      "top_logprobs": [None] + [{f"token_id:{t}": v} for t, v in
                                                                zip(tokens[1:], (s.prompt_logprobs + s.raw)[1:])]}}],
            "usage": {"prompt_tokens": len(s.prompt), "completion_tokens": len(s.response),
                      "total_tokens": len(tokens)}}


def completions_token_ids(s: Generated, tokenizer) -> dict:
    """/v1/completions with return_token_ids and prompt_logprobs: text tokens, ids beside them."""
    return {"id": "cmpl-1", "object": "text_completion", "model": "smollm2",
            "choices": [{"index": 0, "text": tokenizer.decode(s.response), "finish_reason": "length",
                         "logprobs": {"text_offset": list(range(len(s.response))), "token_logprobs": s.raw,
                                      "tokens": [tokenizer.decode([t]) for t in s.response],
                                      "top_logprobs": [{tokenizer.decode([t]): v} for t, v in zip(s.response, s.raw)]},
                         "prompt_token_ids": s.prompt, "token_ids": s.response,
                         "prompt_logprobs": _vllm_dicts(s.prompt, s.prompt_logprobs, tokenizer)}]}


def chat(s: Generated, tokenizer) -> dict:
    """Chat completions logprobs (text tokens with their bytes), vLLM's prompt_token_ids beside them."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    content = []
    for t, v in zip(s.response, s.raw):
        raw = [to_byte[c] for c in tokenizer.convert_ids_to_tokens(t)]
        content.append({"token": bytes(raw).decode("utf-8", errors="replace"), "logprob": v, "bytes": raw,
                        "top_logprobs": []})
    return {"id": "chatcmpl-0", "object": "chat.completion", "model": "smollm2", "prompt_token_ids": s.prompt,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": tokenizer.decode(s.response)},
                         "logprobs": {"content": content, "refusal": None}, "finish_reason": "length"}]}


def wrong_ids(samples: list[Generated], tokenizer, where: Optional[list[tuple[int, int]]] = None) -> list[Generated]:
    """The engine's logprobs on ids it did not sample: every response id shifted by one in the vocabulary (another
    tokenizer's numbering), or, at `where` ((sample, response token) pairs), the id of the "\ufffd" token, as a
    token that splits a UTF-8 character is read back from the "\ufffd" bytes vLLM writes for it."""
    [replacement] = tokenizer.encode("\ufffd")
    changed = []
    for i, s in enumerate(samples):
        response = [(t + 1) % len(tokenizer) for t in s.response] if where is None else \
            [replacement if (i, k) in where else t for k, t in enumerate(s.response)]
        changed.append(Generated(s.prompt, response, s.raw, s.scaled, s.prompt_logprobs))
    return changed


def jsonl(samples: list[Generated], shift: bool = False) -> list:
    """megalign's JSONL; `shift`: each token given its successor's logprob (the one-position bug)."""
    return [{"prompt_ids": s.prompt, "response_ids": s.response,
             "response_logprobs": s.raw[1:] + s.raw[-1:] if shift else s.raw} for s in samples]


def slime(samples: list[Generated]) -> list:
    return [{"tokens": s.prompt + s.response, "response_length": len(s.response), "rollout_log_probs": s.raw,
             "loss_mask": [1] * len(s.response), "reward": 0.0, "status": "completed"} for s in samples]


def write_all(folder: Path, samples: list[Generated], tokenizer) -> dict[str, Path]:
    """Every format (and the twins) as files in `folder`, by name."""
    files = {"sglang.json": sglang(samples),
             "vllm.json": vllm_offline(samples, tokenizer),
             "completions-echo.json": [completions_echo_token_ids(s) for s in samples],
             "completions-ids.json": [completions_token_ids(s, tokenizer) for s in samples],
             "chat.jsonl": [chat(s, tokenizer) for s in samples],
             "rollout.jsonl": jsonl(samples),
             "slime.jsonl": slime(samples),
             "twin-temperature.json": sglang(samples, scaled=True),
             "twin-shift.jsonl": jsonl(samples, shift=True),
             "twin-wrong-ids.jsonl": jsonl(wrong_ids(samples, tokenizer)),
             "twin-temperature-ufffd.json": sglang(wrong_ids(samples, tokenizer, UFFFD_AT), scaled=True),
             "twin-unknown.jsonl": [{"input": PROMPTS[0], "output": "Paris", "score": 1.0, "step": 3}] * 2}
    paths = {}
    for name, content in files.items():
        path = folder / name
        text = "\n".join(json.dumps(c) for c in content) + "\n" if name.endswith(".jsonl") else json.dumps(content)
        path.write_text(text)
        paths[name] = path
    return paths
