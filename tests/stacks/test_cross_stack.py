"""The same Hugging Face checkpoint through transformers and through megatron-core, compared.

Tiny random Llama, Qwen2 and Qwen3 checkpoints are built with transformers on the fly (no
downloads; norm weights and biases randomised so that they matter). Each megatron dump is made
once (conftest's `dump`, ~10 s a launch); the HF stack runs in-process in about a second. Every
passing comparison has a failing twin: the same megatron dump against an HF run of a checkpoint
with one query head's rows swapped with a key head's in layer 0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import invoke, max_abs_diffs, tensors
from planted import swap_query_and_key_head, with_config

LOGITS_TOLERANCE = 1e-4
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # An odd vocab: TP=2 must pad megatron's vocab and cut it off again before dumping.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"vocab_size": 127}),
    # Tied embeddings, and a head_dim that is not hidden_size / heads.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True, "head_dim": 32}),
}
# (family, megatron layout): each is one megatron backward launch.
# qwen3 at PP=2: its tied embeddings have a copy on the last stage, all-reduced at build time.
LAYOUTS = [("llama", ("--cp", "1")), ("llama", ("--cp", "2")), ("qwen2", ("--tp", "2")), ("qwen3", ("--cp", "2")),
           ("qwen3", ("--pp", "2"))]
QKV0 = "decoder.layers.0.self_attention.linear_qkv"
MEGATRON_PARAMS = {"llama": 15, "qwen2": 17, "qwen3": 18}  # qwen2: +2 qkv biases; qwen3: +4 qk norms, -1 tied output


def build_checkpoint(family: str, path: Path, families: dict = FAMILIES, tiny: dict = TINY) -> Path:
    """A tiny random checkpoint of `family` saved by transformers; norm weights and biases randomised
    so that they matter."""
    import transformers

    config_cls, model_cls, extra = families[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**tiny, **extra}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> checkpoint folder; `family + "-swapped"` for its q/k-swapped twin."""
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for family in FAMILIES:
        made[family] = build_checkpoint(family, root / family)
        made[f"{family}-swapped"] = swap_query_and_key_head(made[family], root / f"{family}-swapped")
    return made


def compare(a: Path, b: Path, report: Path):
    result = invoke("compare", a, b, "--json", report)
    records = [json.loads(line) for line in report.read_text().splitlines()]
    return result, records[:-1], records[-1]


def hf_dump(dump, checkpoints, name: str) -> Path:
    return dump("backward", "--hf", checkpoints[name], "--stack", "hf")


@pytest.mark.parametrize("family,layout", LAYOUTS, ids=[f"{f}-{'-'.join(l)}" for f, l in LAYOUTS])
def test_megatron_matches_hf_layer_by_layer(dump, checkpoints, tmp_path, family, layout):
    megatron = dump("backward", "--hf", checkpoints[family], *layout)
    result, rows, summary = compare(hf_dump(dump, checkpoints, family), megatron, tmp_path / "r.jsonl")
    assert result.exit_code == 0, result.output
    assert summary["ok"] and summary["failed"] == 0
    passed = {(r["kind"], r["name"]) for r in rows if r["status"] == "pass"}
    lined_up = {("activation", "embedding"), ("activation", "decoder.final_layernorm"), ("logits", "logits"),
                ("logprobs", "logprobs"), ("loss", "loss"), ("activation", f"{QKV0}"),
                # o_proj's and down_proj's inputs on the HF side: attention output and SwiGLU output.
                ("activation", "decoder.layers.0.self_attention.core_attention"),
                ("activation", "decoder.layers.1.mlp.linear_fc2#input"),
                *(("activation", f"decoder.layers.{i}") for i in range(TINY["num_hidden_layers"]))}
    assert lined_up <= passed, lined_up - passed
    diffs = max_abs_diffs(hf_dump(dump, checkpoints, family), megatron)
    assert diffs["logits", "logits"] < LOGITS_TOLERANCE
    assert tensors(megatron)["logits", "logits"].shape[-1] == FAMILIES[family][2].get("vocab_size", 128)
    # HF-only modules are listed, not silently dropped.
    assert any(r["status"] == "only_a" and r["name"].startswith("model.layers.0.") for r in rows)


@pytest.mark.parametrize("family,layout", LAYOUTS, ids=[f"{f}-{'-'.join(l)}" for f, l in LAYOUTS])
def test_parameter_gradients_match_across_stacks(dump, checkpoints, family, layout):
    megatron = dump("backward", "--hf", checkpoints[family], *layout)
    diffs = max_abs_diffs(hf_dump(dump, checkpoints, family), megatron, kinds=("param_grad", "loss"))
    grads = {name: d for (kind, name), d in diffs.items() if kind == "param_grad"}
    assert len(grads) == MEGATRON_PARAMS[family], sorted(grads)
    assert f"{QKV0}.weight" in grads and "decoder.layers.1.mlp.linear_fc1.weight" in grads
    assert max(grads.values()) < 1e-5, grads
    assert diffs["loss", "loss"] < 1e-6


@pytest.mark.parametrize("family,layout", LAYOUTS, ids=[f"{f}-{'-'.join(l)}" for f, l in LAYOUTS])
def test_twin_swapped_heads_on_hf_side_diverge_at_layer0_attention(dump, checkpoints, tmp_path, family, layout):
    """The failing twin of both tests above: forward and gradients diverge, first at layer 0's QKV."""
    megatron = dump("backward", "--hf", checkpoints[family], *layout)
    result, rows, summary = compare(hf_dump(dump, checkpoints, f"{family}-swapped"), megatron, tmp_path / "r.jsonl")
    assert result.exit_code == 1, result.output
    assert summary["first_divergence"] == f"activation {QKV0}"
    assert summary["first_failure_by_kind"]["param_grad"]
    assert max_abs_diffs(hf_dump(dump, checkpoints, f"{family}-swapped"), megatron)["logits", "logits"] > 1e-3


def test_swapped_megatron_checkpoint_is_caught_at_layer0_attention(dump, checkpoints, tmp_path):
    """The issue's scenario: the megatron side loads a checkpoint whose q/k rows were swapped."""
    megatron = dump("backward", "--hf", checkpoints["llama-swapped"], "--cp", "1")
    result, rows, summary = compare(hf_dump(dump, checkpoints, "llama"), megatron, tmp_path / "r.jsonl")
    assert result.exit_code == 1, result.output
    assert summary["first_divergence"] == f"activation {QKV0}"
    assert f"first divergence: activation {QKV0}" in result.output
    first = next(r for r in rows if r["first_divergence"])
    assert first["layer"] == 0 and first["status"] == "fail"
    before = [r for r in rows if r["order"] < first["order"] and r["status"] in ("pass", "fail")]
    assert before and all(r["status"] == "pass" for r in before)  # embedding, input norm: still equal


def test_hf_dump_is_a_complete_megalign_dump(dump, checkpoints):
    path = hf_dump(dump, checkpoints, "qwen3")
    meta = json.loads((path / "dump.json").read_text())
    assert meta["stack"] == "hf" and meta["world_size"] == 1 and meta["model"]["qk_layernorm"]
    assert meta["hf_checkpoint"] == str(checkpoints["qwen3"]) and meta["transformers"]
    names = {name for _, name in tensors(path)}
    assert "decoder.layers.0.self_attention.q_layernorm" in names and "embedding.word_embeddings.weight" in names
    assert not any(name.startswith("lm_head") for name in names)  # tied: one gradient, under megatron's name


@pytest.mark.parametrize("stack", ["megatron", "hf"])
def test_user_errors_are_one_line_exit_2(checkpoints, tmp_path, stack):
    llama = checkpoints["llama"]
    missing = shutil.copytree(llama, tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    corrupt = shutil.copytree(llama, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes()[:1000])
    (tmp_path / "big.json").write_text("[[1, 2, 127]]")
    cases = [
        (["--hf", with_config(llama, tmp_path / "mistral", model_type="mistral",
                               architectures=["MistralForCausalLM"])],
         "unsupported architecture MistralForCausalLM; supported: LlamaForCausalLM"),
        (["--hf", missing], "no safetensors weights"),
        (["--hf", corrupt], "corrupt safetensors file"),
        (["--hf", with_config(llama, tmp_path / "gelu", hidden_act="gelu")], "only silu"),
        (["--hf", with_config(llama, tmp_path / "llama3", rope_parameters={"rope_type": "llama3", "rope_theta": 1e4,
                                                                             "factor": 8.0})],
         "RoPE scaling 'llama3' is not supported"),
        (["--hf", checkpoints["qwen2"], "--tokens", tmp_path / "big.json"],
         "token id 127 outside the vocabulary [0, 127)"),
        (["--hf", llama, "--config", "configs/tiny.yaml"], "--hf and --config cannot be combined"),
        (["--hf", tmp_path / "nowhere"], "no such checkpoint folder"),
    ]
    for args, message in cases:
        result = invoke("forward", *args, "--stack", stack, "--out", tmp_path / "out")
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output, (args, result.output)


def test_stack_hf_needs_a_checkpoint_and_one_process(checkpoints, tmp_path):
    result = invoke("forward", "--stack", "hf", "--out", tmp_path / "a")
    assert result.exit_code == 2 and "--stack hf needs a checkpoint" in result.output
    result = invoke("forward", "--stack", "hf", "--hf", checkpoints["llama"], "--cp", "2", "--out", tmp_path / "b")
    assert result.exit_code == 2 and "--tp, --pp, --cp, --dp and --ep must be 1" in result.output


def test_check_runs_a_checkpoint_through_both_stacks_against_an_fp64_reference(checkpoints, tmp_path):
    """docs/compare.md's `megalign check --hf CKPT --tokens ... --baseline "--stack hf" --target "--tp 3"
    --reference`, on the tiny Llama at TP=2; the twin's target (forward only, the cheaper) loads the q/k-swapped
    checkpoint instead."""
    tokens = tmp_path / "tokens.json"
    # Ids from both halves of the vocabulary: a TP rank whose vocab shard no token reaches has an all-zero
    # embedding gradient, which the run's coverage check takes for a missing one.
    tokens.write_text(json.dumps([list(range(0, 128, 8)), list(range(5, 125, 10))]))
    common = ("check", "--hf", checkpoints["llama"], "--tokens", tokens, "--baseline", "--stack hf",
              "--filter", r"layers\.(0|1)\.input_layernorm(\.weight)?$|^logits$|^logprobs$|^loss$")
    result = invoke(*common, "--target", "--tp 2", "--reference", "--out", tmp_path / "check")
    assert result.exit_code == 0, result.output
    assert "hf backward" in result.output and "tp=2" in result.output and "fp64 (the reference)" in result.output
    assert "rel to reference" in result.output

    twin = invoke(*common, "--target", f"--hf {checkpoints['llama-swapped']} --tp 2", "--mode", "forward",
                  "--out", tmp_path / "twin")
    assert twin.exit_code == 1, twin.output
    assert "first divergence: activation decoder.layers.1.input_layernorm" in twin.output  # the first kept after layer 0's attention
