"""Engines' files as they come (issue 41): the fixtures in fixtures/ are shaped as each engine's version
writes them (fixtures/README.md), on SmolLM2's real ids and logprobs (fixtures/make.py). Each is read
without a converter, or its unreadable part said; four of them (one prompt, one response: a vLLM
completions stream, vLLM's echo with n=2, SGLang's /generate streams) run end to end against one
`megalign forward --rollout` dump of the real checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import error_line, invoke
from real_checkpoint import build

from megalign.errors import UserError
from megalign.rollouts.read import is_rollout_file, read_rollout

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ONE_SEQUENCE = ("vllm-0.16-completions-stream.sse", "vllm-0.16-completions-echo-n2.json",
                "sglang-0.5-generate-stream.sse", "sglang-0.5-generate-stream-incremental.sse")
DUMPED = ("--filter", "^logits$|^logprobs$")


@pytest.fixture(scope="session")
def checkpoint():
    return build()


@pytest.fixture(scope="session")
def trainer(checkpoint, dump):
    """The one forward dump the one-sequence fixtures share: the real checkpoint on their tokens."""
    return dump("forward", "--hf", checkpoint, "--rollout", FIXTURES / ONE_SEQUENCE[0], *DUMPED)


def fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


def test_vllm_nulls_echo_with_n2_and_replacement_characters(checkpoint, tmp_path):
    """vLLM 0.16 echo, n=2, without token ids: token_ids, prompt_token_ids, prompt_logprobs and stop_reason
    null read as absent (refused: "expected a list of token ids"); the prompt is usage.prompt_tokens for
    both choices (refused with n>1); choice 1's emoji arrives as U+FFFD pieces, which SmolLM2's own "�"
    token silently took: that choice is left out, and said."""
    rollout = read_rollout(FIXTURES / "vllm-0.16-completions-echo-n2.json", checkpoint)
    content = fixture("vllm-0.16-completions-echo-n2.json")
    prompt = content["usage"]["prompt_tokens"]
    assert len(rollout.samples) == 1 and len(rollout.samples[0].prompt) == prompt
    [note] = rollout.notes()
    assert note.startswith("left out: ") and "choices[1].logprobs.tokens[6]: token ' \ufffd' is spelled with U+FFFD" in note
    assert "return_token_ids" in note
    without = dict(content, choices=content["choices"][:1] + [dict(content["choices"][0], index=1)])
    twin = tmp_path / "echo-n2.json"  # the n=2 twin without the emoji: both choices read
    twin.write_text(json.dumps(without))
    assert [s.tokens for s in read_rollout(twin, checkpoint).samples] == [rollout.samples[0].tokens] * 2


def test_only_unmappable_choices_is_one_line(checkpoint, tmp_path):
    """The emoji choice alone (its null fields dropped, as an older vLLM writes it) was mapped silently:
    now nothing of it can be run, and forward says why in one line."""
    content = fixture("vllm-0.16-completions-echo-n2.json")
    choice = {k: v for k, v in content["choices"][1].items() if v is not None}
    only = tmp_path / "emoji.json"
    only.write_text(json.dumps(dict(content, choices=[dict(choice, index=0)])))
    result = invoke("forward", "--hf", checkpoint, "--rollout", only, "--out", tmp_path / "o")
    assert result.exit_code == 2 and "U+FFFD" in error_line(result), result.output
    assert not (tmp_path / "o").exists()


def test_streams_read_as_the_whole_response(checkpoint):
    """vLLM's completions stream (a chunk a token, prompt ids on the first, a usage chunk, [DONE]) and
    SGLang's /generate stream, cumulative and incremental, give the one response they stream."""
    read = {name: read_rollout(FIXTURES / name, checkpoint).samples for name in ONE_SEQUENCE}
    echo = read["vllm-0.16-completions-echo-n2.json"][0]
    for name, samples in read.items():
        assert len(samples) == 1 and samples[0].tokens == echo.tokens, name
        assert samples[0].response_logprobs == pytest.approx(echo.response_logprobs, abs=1e-12), name
    sglang = read["sglang-0.5-generate-stream.sse"][0]
    assert sglang.prompt_logprobs == read["sglang-0.5-generate-stream-incremental.sse"][0].prompt_logprobs
    assert sglang.prompt_logprobs[1:] == pytest.approx(echo.prompt_logprobs[1:], abs=1e-12)
    chat = read_rollout(FIXTURES / "vllm-0.16-chat-stream.sse", checkpoint).samples
    assert [len(s.response) for s in chat] == [len(fixture_chunks("vllm-0.16-chat-stream.sse")) - 1]


def fixture_chunks(name: str) -> list[dict]:
    return [json.loads(line[5:]) for line in (FIXTURES / name).read_text().splitlines()
            if line.startswith("data:") and "[DONE]" not in line]


def test_a_stream_cut_short_or_of_an_error_is_one_line(tmp_path):
    text = (FIXTURES / "vllm-0.16-completions-stream.sse").read_text()
    for name, body, words in (("cut.sse", text[:text.index("\n\n") + 30], "not JSON"),
                              ("error.sse", 'data: {"error": {"message": "boom", "code": 500}}\n\ndata: [DONE]\n',
                               "streamed an error: {'message': 'boom'")):
        (tmp_path / name).write_text(body)
        with pytest.raises(UserError, match=words):
            read_rollout(tmp_path / name)


def test_sglang_chat_with_meta_info(checkpoint):
    """The form agentic RL rollouts use (it was "not a rollout file"): ids from meta_info, the prompt the
    choice's prompt_token_ids, whatever its text tokens (choice 1's emoji bytes are U+FFFD's)."""
    content = fixture("sglang-0.5-chat-meta-info.json")
    samples = read_rollout(FIXTURES / "sglang-0.5-chat-meta-info.json").samples
    assert [s.prompt for s in samples] == [c["prompt_token_ids"] for c in content["choices"]]
    assert [s.response for s in samples] == [[e[1] for e in c["meta_info"]["output_token_logprobs"]]
                                             for c in content["choices"]]


def test_chat_bytes_of_a_replacement_character_are_never_mapped(checkpoint, tmp_path):
    """SGLang's chat without meta_info: bytes from each token's decoded text, so choice 1's emoji pieces are
    U+FFFD's, which SmolLM2's own "\ufffd" token took silently. That choice is left out; choice 0 reads."""
    content = fixture("sglang-0.5-chat-meta-info.json")
    plain = tmp_path / "chat.json"
    plain.write_text(json.dumps(dict(content, choices=[{k: v for k, v in c.items() if k != "meta_info"}
                                                       for c in content["choices"]])))
    rollout = read_rollout(plain, checkpoint)
    assert [s.response for s in rollout.samples] == [[e[1] for e in content["choices"][0]["meta_info"]
                                                      ["output_token_logprobs"]]]
    [note] = rollout.notes()
    assert "choices[1].logprobs.content[2]: token ' \ufffd' is spelled with U+FFFD" in note, note


def test_sglang_default_input_entry_is_checked_against_the_last_prompt_id(tmp_path):
    """By default SGLang returns one input_token_logprobs entry, the last prompt token: prompt ids that end
    otherwise are not the prompt it ran (they read silently)."""
    choice = fixture("sglang-0.5-chat-meta-info.json")["choices"][0]
    item = {"text": choice["message"]["content"], "output_ids": None, "meta_info": choice["meta_info"],
            "prompt_token_ids": choice["prompt_token_ids"][:-1] + [choice["prompt_token_ids"][-1] + 1]}
    planted = tmp_path / "generate.json"
    planted.write_text(json.dumps(item))
    with pytest.raises(UserError, match=r"input_token_logprobs ends with token ids \[\d+\], the prompt_token_ids "
                                        r"with \[\d+\]: they are not the prompt SGLang ran"):
        read_rollout(planted)
    planted.write_text(json.dumps(dict(item, prompt_token_ids=choice["prompt_token_ids"])))
    assert read_rollout(planted).samples[0].prompt == choice["prompt_token_ids"]


class NotWeights:
    """What a pickle may hold beyond tensors and plain containers: weights_only refuses it."""


def test_slime_debug_rollout_pt(tmp_path):
    """slime 0.3.1's --save-debug-rollout-data file (it failed with a UnicodeDecodeError): read with
    weights_only=True; the sample with rollout_log_probs None runs and is said not compared; a .pt of
    plain tensors stays a tensor file for compare, and one that needs unpickling beyond weights_only is
    refused in one line."""
    path = FIXTURES / "slime-0.3.1-debug-rollout.pt"
    saved = torch.load(path, weights_only=True)["samples"]
    rollout = read_rollout(path)
    assert is_rollout_file(path) and rollout.tokens() == [s["tokens"] for s in saved]
    assert rollout.recompute_only() == [1] and "recompute only" in rollout.notes()[0]
    assert rollout.samples[0].response_logprobs == saved[0]["rollout_log_probs"]
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    assert not is_rollout_file(tmp_path / "plain.pt")
    # An object of a class of its own: never on torch's weights_only allowlist (megatron-core, once
    # imported in this process, puts PosixPath there: not a test of anything of megalign's).
    torch.save({"rollout_id": 0, "samples": [NotWeights()]}, tmp_path / "unsafe.pt")
    assert not is_rollout_file(tmp_path / "unsafe.pt")
    with pytest.raises(UserError, match="weights_only=True"):
        read_rollout(tmp_path / "unsafe.pt")


@pytest.mark.parametrize("name", ONE_SEQUENCE)
def test_end_to_end_on_the_real_checkpoint(checkpoint, trainer, tmp_path, name):
    """forward --rollout FILE ran once (on the first); each file compares with its dump and passes."""
    result = invoke("compare", FIXTURES / name, trainer, "--format", "plain", "--json", tmp_path / "r.jsonl")
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines()[:-1])}
    assert rows["tokens"]["status"] == rows["logprobs"]["status"] == "pass"
    assert ("left out: " in result.output) == (name == "vllm-0.16-completions-echo-n2.json"), result.output


def test_forward_of_a_slime_pt_says_what_is_not_compared(checkpoint, tmp_path):
    result = invoke("forward", "--hf", checkpoint, "--rollout", FIXTURES / "slime-0.3.1-debug-rollout.pt",
                    "--stack", "hf", *DUMPED, "--out", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "recompute only" in result.output


PHI2 = "vllm-0.16-completions-phi-2.json"  # phi-2 served it: its ids and its text of each token (fixtures/README.md)


def test_another_models_ids_beside_their_text_are_refused(checkpoint, tmp_path):
    """phi-2's ids with phi-2's text of each token, against SmolLM2: they were read silently as SmolLM2's ids (another
    text entirely: " Paris" is id 6342, SmolLM2's " pig"). Under --hf's tokenizer most ids spell other text than the
    engine's: refused in one line. Without --hf there is nothing to check them against, and they read."""
    with pytest.raises(UserError, match=r"choices\[0\]\.token_ids: another model's tokenizer: \d+ of 22 token ids do "
                                        r"not spell the engine's text of their token under --hf .*smollm2-135m's "
                                        r"tokenizer \(the first, \[0\]: id 6342 is ' pig', the engine's text ' Paris'\)"):
        read_rollout(FIXTURES / PHI2, checkpoint)
    result = invoke("forward", "--hf", checkpoint, "--rollout", FIXTURES / PHI2, "--out", tmp_path / "o")
    assert result.exit_code == 2 and "another model's tokenizer" in error_line(result), result.output
    assert read_rollout(FIXTURES / PHI2).samples[0].response == fixture(PHI2)["choices"][0]["token_ids"]


def test_another_models_ids_alone_are_a_wrong_model(checkpoint, dump, tmp_path):
    """The same response with return_tokens_as_token_ids: the ids are its only spelling, so they run; compare of
    SmolLM2 on them names a wrong model, tokenizer or ids (most sampled tokens improbable to the trainer), not a
    sampling setting."""
    path = FIXTURES / "vllm-0.16-completions-phi-2-token-ids.json"
    trainer = dump("forward", "--hf", checkpoint, "--rollout", path, *DUMPED)
    result = invoke("compare", path, trainer, "--format", "plain")
    assert result.exit_code == 1, result.output
    said = [line for line in result.output.splitlines() if line.startswith("cause:")]
    assert len(said) == 1 and said[0].startswith("cause: wrong model, tokenizer or ids: "), result.output
    assert "of the 22 sampled tokens are improbable to the trainer" in said[0], said


@pytest.mark.parametrize("name, drop, asked", (
    ("vllm-0.16-completions-stream.sse", "prompt_token_ids",
     ("return_token_ids=true (vLLM 0.10.2+ and SGLang", "echo=true with logprobs")),
    ("vllm-0.16-chat-stream.sse", "prompt_token_ids",
     ("return_token_ids=true (vLLM 0.10.2+", "SGLang: each choice's prompt_token_ids and response_token_ids",
      "return_prompt_token_ids=true with return_meta_info=true")),
    ("sglang-0.5-chat-meta-info.json", "prompt_token_ids",
     ("return_prompt_token_ids=true (or return_token_ids=true) with return_meta_info=true",)),
    ("sglang-0.5-generate-stream.sse", "input_token_logprobs",
     ("return_prompt_token_ids=true, or logprob_start_len=0",)),
))
def test_a_missing_prompt_names_each_engines_option(tmp_path, name, drop, asked):
    """Where the prompt's ids are not in a file, the advice names the options of the engine that wrote it, vLLM's and
    SGLang's alike (sglang 0.5.23's request fields; it named vLLM's alone for OpenAI-compatible files)."""
    def without(value):
        if isinstance(value, dict):
            return {k: without(v) for k, v in value.items() if k != drop}
        return [without(v) for v in value] if isinstance(value, list) else value

    text = (FIXTURES / name).read_text()
    if name.endswith(".sse"):
        chunks = [without(c) for c in fixture_chunks(name)]
        if drop == "input_token_logprobs":  # SGLang's default: one input entry, the last prompt token's
            for c in chunks:
                c["meta_info"]["input_token_logprobs"] = []
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    else:
        text = json.dumps(without(json.loads(text)))
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError, match="the prompt's token ids are not in the file") as caught:
        read_rollout(tmp_path / name)
    for words in asked:
        assert words in str(caught.value), str(caught.value)


def test_sglang_chat_response_token_ids_are_read(checkpoint, tmp_path):
    """SGLang's chat with return_token_ids=true and no meta_info names the response's ids response_token_ids
    (sglang 0.5.23 ChatCompletionResponseChoice): read by id, so choice 1's emoji (U+FFFD bytes) reads too. It was
    left out, its ids ignored."""
    content = fixture("sglang-0.5-chat-meta-info.json")
    responses = [[e[1] for e in c["meta_info"]["output_token_logprobs"]] for c in content["choices"]]
    choices = [dict({k: v for k, v in c.items() if k != "meta_info"}, response_token_ids=r)
               for c, r in zip(content["choices"], responses)]
    path = tmp_path / "chat-token-ids.json"
    path.write_text(json.dumps(dict(content, choices=choices)))
    rollout = read_rollout(path, checkpoint)
    assert [s.response for s in rollout.samples] == responses and not rollout.notes()


def test_the_docs_vllm_offline_snippet_writes_what_the_reader_takes(monkeypatch, tmp_path):
    """docs/rollouts.md's lines that save LLM.generate's outputs, run as written on stand-ins for vLLM's objects
    (vLLM is not installed here): dataclasses with the attribute names of vllm/outputs.py's RequestOutput and
    CompletionOutput and vllm/logprobs.py's Logprob, holding what vLLM holds (each position's {token_id: Logprob}
    with the sampled token among the top-k, prompt_logprobs None at entry 0, token_ids a tuple, n = 2). The file it
    writes reads back as the same prompt, responses and logprobs."""
    @dataclass
    class Logprob:
        logprob: float
        rank: int
        decoded_token: str

    @dataclass
    class CompletionOutput:
        index: int
        text: str
        token_ids: tuple
        cumulative_logprob: float
        logprobs: list
        finish_reason: str
        stop_reason: None = None

    @dataclass
    class RequestOutput:
        request_id: str
        prompt: str
        prompt_token_ids: list
        prompt_logprobs: list
        outputs: list
        finished: bool = True

    def positions(tokens, values):  # the sampled token and, ranked first, another
        return [None if v is None else {t + 1: Logprob(-0.1, 1, "x"), t: Logprob(v, 2, "y")}
                for t, v in zip(tokens, values)]

    echo = read_rollout(FIXTURES / "vllm-0.16-completions-stream.sse").samples[0]
    prompt_values = [None] + [-1.5 - k for k in range(len(echo.prompt) - 1)]
    outputs = [RequestOutput("0", "The capital of France is", echo.prompt, positions(echo.prompt, prompt_values),
                             [CompletionOutput(j, "", tuple(echo.response), sum(echo.response_logprobs),
                                               positions(echo.response, echo.response_logprobs), "length")
                              for j in range(2)])]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "rollouts.md").read_text()
    snippet = doc.split("### vLLM offline")[1].split("```python\n")[1].split("```")[0]
    kept = [line for line in snippet.splitlines() if not line.startswith(("from vllm ", "llm = ", "outputs = "))]
    assert len(kept) == len(snippet.splitlines()) - 3, snippet  # only the lines that need vLLM itself
    monkeypatch.chdir(tmp_path)
    exec("\n".join(kept), {"outputs": outputs})
    samples = read_rollout(tmp_path / "rollout.json").samples
    assert [(s.prompt, s.response, s.response_logprobs) for s in samples] == \
        [(echo.prompt, echo.response, echo.response_logprobs)] * 2
    assert samples[0].prompt_logprobs == prompt_values
