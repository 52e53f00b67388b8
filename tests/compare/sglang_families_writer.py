"""What an sglang server's dumper (non-intrusive hooks in `all` mode) writes for a DeepSeek-V3 or GLM-4.5
model, with sglang's own dumper code (sglang_writer.load_sglang_dumper), the values taken from a megalign
dump of the same model (`megalign backward --stack hf`: transformers' computation).

Each tensor is written under the name sglang 0.5.23's model classes give the module (the file and line
of each are in SGLANG below), in the form sglang's forward returns it: the norms (normed, residual)
(srt/layers/layer_boundary/residual/access.py:51; layer 0's input norm has no residual yet), a decoder
layer its FFN's contribution alone (layer_boundary/stage.py `finish`), MLA's `fused_qkv_a_proj_with_mqa`
q_a | kv_a (deepseek_v2.py:2527-2534, prepare_qkv_latent's order where they are apart), `kv_b_proj` only
in the prefill (MHA) pass, the MoE's `topk` (weights, ids, logits) (layers/moe/topk.py:363) with the
ids in no order and the weights without routed_scaling_factor (applied after the experts), and
`experts` the routed experts' sum.

Two passes: every request's prefill but its last token, then one decode pass of both. Writes OUT/plain
and OUT/kv-q, the latter with the fused projection kv_a | q_a (the order wrong).

    python sglang_families_writer.py MEGALIGN_DUMP OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from sglang_writer import load_sglang_dumper

from megalign.compare.sources import open_source

A = "model.layers.{i}.self_attn"
M = "model.layers.{i}.mlp"


def tensors(source) -> dict[str, torch.Tensor]:
    """The megalign dump's activations, routing, logits and tokens as [requests, positions, ...]."""
    out = {}
    for entry in source.entries:
        if entry.kind in ("activation", "routing", "logits", "input") and entry.seq_dim is not None:
            out[entry.name] = entry.load().tensor.movedim((entry.batch_dim, entry.seq_dim), (0, 1))
    return out


def module_outputs(t: dict[str, torch.Tensor], layers: int, scaling: float, kv_q: bool) -> dict:
    """sglang's dumped name -> [requests, positions, ...], in the order the model runs them; the MHA-only
    kv_b_proj under ("kv_b_proj", layer). Names as sglang's model classes give the modules: deepseek_v2.py
    (DeepseekV2AttentionMLA.__init__ 2070-2163, DeepseekV2MoE.__init__ 726-888, DeepseekV2MLP.__init__
    305-334), glm4_moe.py (Glm4MoeAttention 257-268, Glm4MoeSparseMoeBlock 434-474, Glm4MoeMLP 173-194),
    the decoder layer's and model's as llama.py's."""
    out = {"model.embed_tokens.output": t["embedding"]}
    for i in range(layers):
        m, a, mlp = f"decoder.layers.{i}", A.format(i=i), M.format(i=i)

        def put(name: str, record: str) -> None:
            if f"{m}.{record}" in t:
                out[name] = t[f"{m}.{record}"]

        before = t["embedding"] if i == 0 else t[f"decoder.layers.{i - 1}"]
        norm = f"model.layers.{i}.input_layernorm.output"
        out.update({norm: t[f"{m}.input_layernorm"]} if i == 0 else
                   {f"{norm}.0": t[f"{m}.input_layernorm"], f"{norm}.1": before})
        kv_down = t.get(f"{m}.self_attention.linear_kv_down_proj")
        if kv_down is not None:  # multi-latent attention (GLM's q|k|v qkv_proj, its q_norm and k_norm unwritten)
            q_down = t.get(f"{m}.self_attention.linear_q_down_proj")
            if q_down is not None:
                out[f"{a}.fused_qkv_a_proj_with_mqa.output"] = torch.cat([kv_down, q_down] if kv_q else [q_down, kv_down],
                                                                         -1)
                out[f"{a}.q_a_layernorm.inputs.0"] = q_down
            put(f"{a}.q_a_layernorm.output", "self_attention.q_layernorm")
            out[f"{a}.kv_a_layernorm.inputs.0"] = kv_down[..., :t[f"{m}.self_attention.kv_layernorm"].shape[-1]]
            put(f"{a}.kv_a_layernorm.output", "self_attention.kv_layernorm")
            put(f"{a}.q_b_proj.output", "self_attention.linear_q_up_proj")
            out["kv_b_proj", i] = t[f"{m}.self_attention.linear_kv_up_proj"]
        put(f"{a}.o_proj.inputs.0", "self_attention.core_attention")
        put(f"{a}.o_proj.output", "self_attention.linear_proj")
        put(f"{a}.output", "self_attention")
        out[f"model.layers.{i}.post_attention_layernorm.output.0"] = t[f"{m}.pre_mlp_layernorm"]
        out[f"model.layers.{i}.post_attention_layernorm.output.1"] = before + t[f"{m}.self_attention"]
        put(f"{mlp}.gate.output", "mlp.router.logits")
        if f"{m}.mlp.router.experts" in t:
            ids, weights = t[f"{m}.mlp.router.experts"], t[f"{m}.mlp.router.weights"] / scaling
            shuffle = torch.randperm(ids.shape[-1], generator=torch.Generator().manual_seed(i))
            out.update({f"{mlp}.topk.output.0": weights[..., shuffle], f"{mlp}.topk.output.1": ids[..., shuffle],
                        f"{mlp}.topk.output.2": t[f"{m}.mlp.router.logits"]})
            out[f"{mlp}.experts.output"] = t[f"{m}.mlp"] - t[f"{m}.mlp.shared_experts"]
        put(f"{mlp}.shared_experts.gate_up_proj.output", "mlp.shared_experts.linear_fc1")
        put(f"{mlp}.shared_experts.down_proj.output", "mlp.shared_experts.linear_fc2")
        put(f"{mlp}.shared_experts.output", "mlp.shared_experts")
        put(f"{mlp}.gate_up_proj.output", "mlp.linear_fc1")
        put(f"{mlp}.act_fn.output", "mlp.linear_fc2#input")
        put(f"{mlp}.down_proj.output", "mlp.linear_fc2")
        put(f"{mlp}.output", "mlp")
        out[f"model.layers.{i}.output"] = t[f"{m}.mlp"]  # the FFN's contribution, its residual kept apart
    out["model.norm.output.0"] = t["decoder.final_layernorm"]
    out["model.norm.output.1"] = t[f"decoder.layers.{layers - 1}"]
    return out


def main(source: str, out: str) -> None:
    """OUT/plain and OUT/kv-q, each an sglang dump folder (exp/)."""
    opened = open_source(Path(source))
    t = tensors(opened)
    lengths = [row.lengths[0] for row in opened.rows]  # each request's real tokens
    layers = 1 + max(int(name.split(".")[2]) for name in t if name.startswith("decoder.layers."))
    weights = t.get(f"decoder.layers.{layers - 1}.mlp.router.weights")
    scaling = float(weights[0, 0].sum()) if weights is not None else 1.0  # renormalised, then scaled
    dumper = load_sglang_dumper().dumper
    for kind in ("plain", "kv-q"):
        outputs = module_outputs(t, layers, scaling, kv_q=kind == "kv-q")
        dumper.configure(enable=True, dir=f"{out}/{kind}", exp_name="exp", enable_output_console=False)
        # Every request's prefill but its last token (the MHA pass), then one decode pass of all.
        for mha, where in ((True, [list(range(n - 1)) for n in lengths]), (False, [[n - 1] for n in lengths])):
            dumper.dump("input_ids", torch.cat([t["tokens"][k, w] for k, w in enumerate(where)]))
            dumper.dump("positions", torch.tensor([p for w in where for p in w]))
            dumper.dump("seq_lens", torch.tensor([w[-1] + 1 for w in where]))
            dumper.dump("rids", [f"r{k}" for k in range(len(where))])
            for name, value in outputs.items():
                if isinstance(name, tuple):  # kv_b_proj: in the MHA (prefill) pass only
                    if not mha:
                        continue
                    name = f"model.layers.{name[1]}.self_attn.kv_b_proj.output"
                dumper.dump(f"non_intrusive__{name}", torch.cat([value[k, w] for k, w in enumerate(where)]))
            dumper.dump("non_intrusive__logits_processor.output.next_token_logits",
                        torch.stack([t["logits"][k, w[-1]] for k, w in enumerate(where)]))
            dumper.step()
        dumper.reset()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
