"""A Hugging Face checkpoint folder: config.json and safetensors weights, validated before any launch.

Weights are read from safetensors only (never pickle). A checkpoint is accepted when every tensor
the family's table needs is present and every tensor present is used: a tensor left over means the
mapping would silently drop part of the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from megalign.errors import UserError
from megalign.spec import VOCAB_PARAMS, ModelConfig
from megalign.stacks.hf.families import Family, family_of, model_config
from megalign.stacks.hf.namemap import NameMap

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# Buffers some older exports saved as weights; recomputed by both stacks.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class HFCheckpoint:
    path: Path
    family: Family
    model: ModelConfig
    names: NameMap
    files: dict[str, Path]  # tensor name -> the safetensors file holding it
    # A per-expert tensor the mapping reads -> the fused tensor on disk it is cut from (Experts.unfuse).
    fused: dict[str, str] = field(default_factory=dict)

    def tensor_names(self) -> set[str]:
        """The tensors the mapping can read: the files', the fused ones as their per-expert parts."""
        return (set(self.files) - set(self.fused.values())) | set(self.fused)


def open_checkpoint(path: Path) -> HFCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--hf {path}: no such checkpoint folder")
    raw = _read_config(path / CONFIG)
    family = family_of(raw, str(path / CONFIG))
    model = model_config(raw, family, name=f"{family.model_type}:{path.name}", source=str(path / CONFIG))
    names = NameMap(family, model, family.row_orders(raw, model))
    files = _tensor_files(path)
    checkpoint = HFCheckpoint(path=path, family=family, model=model, names=names, files=files,
                              fused=_fused_parts(family, files))
    _check_coverage(checkpoint)
    return checkpoint


def _read_config(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{file}: missing (a Hugging Face checkpoint folder needs config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{file}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{file}: not a JSON object")
    return raw


def _tensor_files(path: Path) -> dict[str, Path]:
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index}: unreadable index ({e})") from None
        shards = sorted({path / f for f in weight_map.values()})
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
        hint = f" (found {', '.join(pickled)}: pickle files are not read; re-save with safetensors)" if pickled else ""
        raise UserError(f"--hf {path}: no safetensors weights{hint}")
    files = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                files.update({name: shard for name in f.keys()})
        except FileNotFoundError:
            raise UserError(f"{shard}: missing (named by {INDEX})") from None
        except Exception as e:  # safetensors raises several types for a truncated or foreign file
            raise UserError(f"{shard}: corrupt safetensors file ({e})") from None
    return files


def _fused_parts(family: Family, files: dict[str, Path]) -> dict[str, str]:
    """Each per-expert tensor of the family's fused experts -> its fused tensor on disk (shapes read, not data)."""
    if family.experts is None or not family.experts.interleaved:
        return {}
    parts = {}
    for file in set(files.values()):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                fused = torch.empty(f.get_slice(name).get_shape(), device="meta")
                parts.update((part, name) for part in family.experts.unfuse(name, fused) if part != name)
    return parts


def _check_coverage(checkpoint: HFCheckpoint) -> None:
    needed = {hf for _, parts in checkpoint.names.params().values() for hf in parts} | \
        set(checkpoint.names.buffers().values())
    # Some exports also save the tied copy of the embeddings as lm_head.weight.
    allowed = needed | ({"lm_head.weight"} if checkpoint.model.tie_embeddings else set())
    present = checkpoint.tensor_names()
    missing = sorted(needed - present)
    if missing:
        raise UserError(f"--hf {checkpoint.path}: {len(missing)} tensor(s) missing for {checkpoint.family.architecture}"
                        f": {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))
    extra = sorted(n for n in present - allowed
                   if not n.endswith(IGNORED_SUFFIXES) and not _is_mtp(n, checkpoint.model.num_layers))
    if extra:
        raise UserError(f"--hf {checkpoint.path}: tensor(s) the {checkpoint.family.architecture} mapping cannot "
                        f"place: {', '.join(extra[:4])}" + (" ..." if len(extra) > 4 else ""))


def _is_mtp(name: str, layers: int) -> bool:
    """DeepSeek-V3's and GLM-4.5's multi-token-prediction layers follow the decoder's, as
    model.layers.{num_hidden_layers}...: neither stack's forward reads them."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= layers


def read_tensors(checkpoint: HFCheckpoint, names) -> list[torch.Tensor]:
    out = []
    for name in names:
        stored = checkpoint.fused.get(name, name)
        with safe_open(str(checkpoint.files[stored]), framework="pt") as f:
            tensor = f.get_tensor(stored)
        out.append(checkpoint.family.experts.unfuse(stored, tensor)[name].contiguous() if stored != name else tensor)
    return out


def megatron_weights(checkpoint: HFCheckpoint) -> Callable[[str, tuple], torch.Tensor]:
    """The `full(global_name, full_shape)` that shard.from_full cuts to each rank's shard."""
    params, buffers = checkpoint.names.params(), checkpoint.names.buffers()

    def full(name: str, shape: tuple) -> torch.Tensor:
        if name in buffers:
            return read_tensors(checkpoint, [buffers[name]])[0]
        if name not in params:
            raise UserError(f"--hf {checkpoint.path}: the {checkpoint.family.architecture} mapping has no source "
                            f"for megatron parameter {name}")
        rule, parts = params[name]
        value = checkpoint.names.join(rule, read_tensors(checkpoint, parts), dim=0)
        if name in VOCAB_PARAMS and value.shape[0] < shape[0]:
            # Padded rows are never looked up, and their logits are masked (model.mask_vocab_padding).
            value = torch.cat([value, value.new_zeros(shape[0] - value.shape[0], *value.shape[1:])])
        return value

    return full
