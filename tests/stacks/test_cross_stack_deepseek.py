"""DeepSeek-V3 checkpoints through transformers and through megatron-core, compared.

Tiny random checkpoints saved by transformers' DeepseekV3ForCausalLM: multi-latent attention, layer 0
dense (first_k_dense_replace=1), layer 1 MoE with 8 experts in 4 groups, top-4 from 2 groups
(num_experts_per_tok // topk_group = 2, the split both stacks rank groups by), sigmoid scores with a
random score-correction bias, one shared expert. The router is made wide enough that the bias moves
a choice but does not decide them all.

An sglang server's dump of the same model (its module names, written by sglang's own dumper from the
transformers run's values: tests/compare/sglang_families_writer.py) lines up with megatron's run.

Twins: megatron loading only the parameters (the expert bias left zero) is caught at layer 1's
routing; a checkpoint with rope_interleave=false whose megatron side skips the transform (the flag
mis-set) is caught at the first output the rope rows reach; the sglang dump with its fused MLA down
projection laid out kv_a | q_a is caught at layer 0's linear_kv_down_proj.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import invoke, max_abs_diffs
from planted import with_config

TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=128, max_position_embeddings=256,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16)
# embedding, final norm, output layer; layer 0: 2 norms, q down/norm/up, kv down/norm/up, proj, fc1, fc2;
# layer 1: the same attention, router, 8 experts x 2, shared fc1 and fc2.
MEGATRON_PARAMS = 3 + 11 + (9 + 1 + 16 + 2)
ROUTER = "decoder.layers.1.mlp.router"


def build_deepseek(path: Path, **changes) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TINY, **changes}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.02)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-deepseek")
    # The halves layout (rope_interleave=false) together with q_lora_rank null: one q_proj, no q latent.
    halves = build_deepseek(root / "halves", rope_interleave=False, q_lora_rank=None)
    return {"plain": build_deepseek(root / "plain"), "halves": halves,
            "halves-misread": with_config(halves, root / "halves-misread", rope_interleave=True)}


def hf_dump(dump, deepseek, name: str, *args: str) -> Path:
    return dump("backward", "--hf", deepseek[name], "--stack", "hf", *args)


LAYOUTS = [(), ("--ep", "2"), ("--cp", "2")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(l) or "tp1" for l in LAYOUTS])
def test_megatron_matches_transformers_on_deepseek_v3(dump, deepseek, layout):
    hf = hf_dump(dump, deepseek, "plain")
    megatron = dump("backward", "--hf", deepseek["plain"], *layout)
    result = invoke("compare", hf, megatron)
    assert result.exit_code == 0, result.output
    assert "100.00% of 64 tokens keep their top-k set, 100.00% its order" in result.output
    diffs = max_abs_diffs(hf, megatron)
    grads = {name: d for (kind, name), d in diffs.items() if kind == "param_grad"}
    assert len(grads) == MEGATRON_PARAMS, sorted(grads)
    assert max(grads.values()) < 1e-6, grads
    for name in ("self_attention.linear_kv_up_proj", "self_attention.core_attention", "mlp"):
        assert diffs["activation", f"decoder.layers.1.{name}"] < 1e-5
    assert diffs["activation", "decoder.layers.1.mlp.shared_experts"] < 1e-5
    assert diffs["logits", "logits"] < 1e-4


def test_bf16_deepseek_v3_passes(dump, deepseek):
    hf = hf_dump(dump, deepseek, "plain", "--dtype", "bf16")
    result = invoke("compare", hf, dump("backward", "--hf", deepseek["plain"], "--dtype", "bf16"))
    assert result.exit_code == 0, result.output


def test_rope_interleave_false_is_transformed(dump, deepseek):
    """The rope rows of q_proj and kv_a_proj_with_mqa interleaved for megatron: the same model computed."""
    result = invoke("compare", hf_dump(dump, deepseek, "halves"), dump("backward", "--hf", deepseek["halves"]))
    assert result.exit_code == 0, result.output


def test_twin_rope_interleave_mis_set_is_caught_where_the_rope_rows_first_show(dump, deepseek):
    """megatron reads the halves checkpoint as if interleaved (the converter's flag wrong): layer 0's
    query projection, whose rope rows megatron then reads in another order, is the first output that differs."""
    misread = dump("backward", "--hf", deepseek["halves-misread"])
    result = invoke("compare", hf_dump(dump, deepseek, "halves"), misread)
    assert result.exit_code == 1, result.output
    assert "first divergence: activation decoder.layers.0.self_attention.linear_q_proj" in result.output


def test_twin_expert_bias_dropped_at_load_is_caught_at_the_routing(dump, deepseek, tmp_path, monkeypatch):
    """A loader that sets only parameters leaves megatron's expert_bias buffer zero: other experts chosen."""
    monkeypatch.setenv("MEGALIGN_FAULT", "parameters-only")
    out = tmp_path / "parameters-only"
    made = invoke("backward", "--hf", deepseek["plain"], "--out", out)
    assert made.exit_code == 0, made.output
    result = invoke("compare", hf_dump(dump, deepseek, "plain"), out)
    assert result.exit_code == 1, result.output
    assert f"first divergence: routing {ROUTER}.experts" in result.output
    assert "routing flip" in result.output


def test_refused_deepseek_settings_are_one_line_exit_2(deepseek, tmp_path):
    plain = deepseek["plain"]
    cases = [
        ({"topk_group": 1}, "num_experts_per_tok // topk_group = 4 // 1 != 2"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false with sigmoid scores"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized weights (fp8) are not read"),
    ]
    for i, (changes, message) in enumerate(cases):
        result = invoke("forward", "--hf", with_config(plain, tmp_path / str(i), **changes), "--out", tmp_path / "o")
        assert result.exit_code == 2 and message in result.output, (changes, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    result = invoke("forward", "--hf", plain, "--tp", "2", "--sp", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "--tp 2 with multi-latent attention" in result.output, result.output


def test_mtp_layers_in_the_checkpoint_are_skipped(deepseek, tmp_path):
    """DeepSeek-V3's multi-token-prediction layer follows the decoder's (model.layers.{num_hidden_layers})."""
    from safetensors.torch import load_file, save_file

    from megalign.stacks.hf.checkpoint import open_checkpoint

    with_mtp = with_config(deepseek["plain"], tmp_path / "mtp")
    (with_mtp / "model.safetensors").unlink()
    weights = load_file(str(deepseek["plain"] / "model.safetensors"))
    weights["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, str(with_mtp / "model.safetensors"), metadata={"format": "pt"})
    checkpoint = open_checkpoint(with_mtp)
    assert checkpoint.names.buffers() == {f"{ROUTER}.expert_bias": "model.layers.1.mlp.gate.e_score_correction_bias"}
    assert "model.layers.2.eh_proj.weight" in checkpoint.files


SGLANG_WRITER = Path(__file__).parents[1] / "compare" / "sglang_families_writer.py"


def sglang_server(source: Path, out: Path) -> dict[str, Path]:
    """{"plain": folder, "kv-q": folder}: sglang server dumps of a megalign dump's values (one process)."""
    result = subprocess.run([sys.executable, str(SGLANG_WRITER), str(source), str(out)], capture_output=True, text=True,
                            timeout=600, cwd=SGLANG_WRITER.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return {kind: out / kind / "exp" for kind in ("plain", "kv-q")}


def compare_rows(a: Path, b: Path, report: Path):
    """(the CLI's result, {name: row} of the forward rows) of `megalign compare a b`."""
    result = invoke("compare", a, b, "--json", report, "--format", "plain")
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    return result, {row["name"]: row for row in lines[:-1] if row["kind"] not in ("activation_grad", "param_grad")}


def test_sglang_server_dump_lines_up_with_megatron_by_sglang_module_names(dump, deepseek, tmp_path):
    """Every mapped sglang name (MLA's fused down projection split at q_a_layernorm's width, the router's
    logits, topk's ids sorted by their weights) agrees with megatron-core's run, in either order; the
    fused projection laid out kv_a | q_a fails first at layer 0's linear_kv_down_proj."""
    server = sglang_server(hf_dump(dump, deepseek, "plain"), tmp_path / "sglang")
    megatron = dump("backward", "--hf", deepseek["plain"])
    for a, b in ((server["plain"], megatron), (megatron, server["plain"])):
        result, rows = compare_rows(a, b, tmp_path / "r.jsonl")
        assert result.exit_code == 0, result.output
        passed = {name for name, row in rows.items() if row["status"] == "pass"}
        assert {f"decoder.layers.{i}.self_attention.{m}" for i in (0, 1) for m in (
            "linear_q_down_proj", "linear_kv_down_proj", "q_layernorm", "kv_layernorm", "linear_q_up_proj",
            "core_attention", "linear_proj")} <= passed
        assert {f"{ROUTER}.logits", f"{ROUTER}.experts", "decoder.layers.1.mlp.shared_experts", "logits"} <= passed
        assert "100.00% of 52 tokens keep their top-k set, 100.00% its order" in result.output
    result, rows = compare_rows(server["kv-q"], megatron, tmp_path / "r.jsonl")
    assert result.exit_code == 1, result.output
    assert "first divergence: activation decoder.layers.0.self_attention.linear_kv_down_proj" in result.output
    assert rows["decoder.layers.0.self_attention.linear_q_down_proj"]["status"] == "pass"
