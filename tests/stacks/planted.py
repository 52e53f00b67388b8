"""Planted bugs in Hugging Face checkpoints: copies of a checkpoint with one classic conversion mistake."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def swap_query_and_key_head(source: Path, target: Path) -> Path:
    """Layer 0: the rows of query head 0 and key head 0 trade places (a classic fused-QKV mix-up)."""
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    head_dim = json.loads((target / "config.json").read_text()).get("head_dim") or 16
    q_rows, k_rows = weights[q][:head_dim].clone(), weights[k][:head_dim].clone()
    weights[q][:head_dim], weights[k][:head_dim] = k_rows, q_rows
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def with_config(source: Path, target: Path, **changes) -> Path:
    """A copy whose config.json has `changes`; the weights are linked, not copied."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.name != "config.json":
            (target / file.name).symlink_to(file.resolve())
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def swap_experts(source: Path, target: Path, layer: int) -> Path:
    """Experts 0 and 1 of one layer trade their weights (a converter's expert-index mix-up)."""
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    swapped = {}
    for name, tensor in weights.items():
        for a, b in ((".experts.0.", ".experts.1."), (".experts.1.", ".experts.0.")):
            if f"layers.{layer}." in name and a in name:
                swapped[name.replace(a, b)] = tensor
    weights.update(swapped)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def swap_layers(source: Path, target: Path, a: int, b: int) -> Path:
    """Layers a and b trade all their weights (a converter's layer-index mix-up)."""
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    swapped = {}
    for name, tensor in weights.items():
        for one, other in ((a, b), (b, a)):
            if f".layers.{one}." in name:
                swapped[name.replace(f".layers.{one}.", f".layers.{other}.")] = tensor
    weights.update(swapped)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def drop_expert_bias(source: Path, target: Path) -> Path:
    """Every router's e_score_correction_bias zeroed (what a loader that sets only parameters leaves)."""
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(".e_score_correction_bias"):
            tensor.zero_()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
