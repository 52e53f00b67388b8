"""Dumps written by sglang's dumper (`sglang.srt.debug_utils.dumper`).

The dumper writes one `torch.save({"value": tensor, "meta": {...}})` file per tensor and rank,
named `step=S___rank=R___dump_index=N___name=X___...pt`, under `{dir}/{exp_name}/`; either folder
may be given. Files are read with torch.load(weights_only=True) only.

Names map onto megalign's kinds: `grad__param__X` is the parameter gradient of X (dump_model),
`grad__X` the activation gradient of X, `non_intrusive__M.output` the output of module M (hook
mode), `input_ids` the tokens; anything else is an activation. With several steps, names get a
`stepS/` prefix; a name dumped again in one step gets `@1`, `@2`, ...

A tensor dumped by several ranks is put back together from its `dims` (e.g. `s[cp:zigzag] b h[tp]`)
and each rank's `megatron_parallel_info` / `sglang_parallel_info`: sharded dims are concatenated in
rank order (zigzag undone for `cp:zigzag`, summed for `partial`), ranks that differ only in axes the
dims do not shard hold replicas. Without dims, shards and replicas cannot be told apart: such tensors
are reported as not reassemblable, but for two that megatron's conventions place. Parameter
gradients (`dump_model` writes no dims) are whole on every CP and DP rank and split over TP as
megatron's names say (dump/megatron_params.py). A loss the same on every rank is the reduced loss;
one that differs is per-rank parts reduced in a way the dump does not say: unverifiable.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

from megalign.compare.entries import Entry, ReplicaGap, Source, Value, phase
from megalign.compare.reassemble import first_replica
from megalign.compare.sources.plain import is_regular, load_pt, tensor_value
from megalign.compare.steps import step_name
from megalign.dump.format import layer_of, repeat_name
from megalign.dump.megatron_params import gated_linear, tp_dim_by_name
from megalign.dump.sharding import merge_cp, merge_tp
from megalign.errors import UserError

_REQUIRED = ("step", "rank", "dump_index", "name")
_AXES = ("tp", "cp", "sp", "attn_tp", "attn_cp")
_FC1 = re.compile(r"linear_fc1\.(weight|bias)$")
_MODIFIERS = re.compile(r"^(?P<name>[^\[\]]+)(?:\[(?P<mods>[^\]]+)\])?$")


@dataclass
class _File:
    path: Path
    step: int
    rank: int
    dump_index: int
    name: str
    meta: dict


@dataclass(frozen=True)
class _Split:
    """One sharded axis of the dims: which tensor dim it splits, and how to undo it."""

    dim: int
    axis: str
    zigzag: bool
    partial: bool
    parts: int = 1  # fused parts, each split on its own (SwiGLU's gate|up)


def parse_filename(path: Path) -> Optional[dict]:
    fields = dict(part.split("=", 1) for part in path.stem.split("___") if "=" in part)
    if not all(key in fields for key in _REQUIRED):
        return None
    try:
        return {**fields, "step": int(fields["step"]), "rank": int(fields["rank"]),
                "dump_index": int(fields["dump_index"])}
    except ValueError:
        return None


def dump_files(folder: Path) -> list[Path]:
    """The dumper's files in `folder`: regular files only (a link could lead outside, a FIFO would hang)."""
    return sorted(p for p in folder.glob("*.pt") if parse_filename(p) and is_regular(p))


def _has_dump_files(folder: Path) -> bool:
    return bool(dump_files(folder))


def find_sglang_dir(path: Path) -> Optional[Path]:
    """`path` itself, or its one experiment subfolder, when it holds sglang dumper files."""
    if _has_dump_files(path):
        return path
    found = [d for d in sorted(path.iterdir()) if d.is_dir() and _has_dump_files(d)]
    if len(found) > 1:
        raise UserError(f"{path}: holds several sglang dumps ({', '.join(d.name for d in found)}): pass one of them")
    return found[0] if found else None


def logical_name(dumped: str) -> tuple[str, str]:
    """(kind, name) in megalign's terms for a name as sglang's dumper wrote it."""
    if dumped.startswith("grad__param__"):
        return "param_grad", dumped.removeprefix("grad__param__")
    if dumped.startswith("param__"):
        return "param", dumped.removeprefix("param__")
    kind = "activation"
    if dumped.startswith("grad__"):
        kind, dumped = "activation_grad", dumped.removeprefix("grad__")
    if dumped.startswith("non_intrusive__"):
        module, _, output = dumped.removeprefix("non_intrusive__").rpartition(".output")
        if module and output in ("", ".0"):
            return kind, module
        if module and output[1:].isdigit():
            return kind, f"{module}#{output[1:]}"  # megalign's name for a module's i-th output
        dumped = dumped.removeprefix("non_intrusive__")
    if kind == "activation":
        if dumped == "input_ids":
            return "input", "tokens"
        if dumped in ("position_ids", "loss", "logprobs", "logits"):
            return ("input" if dumped == "position_ids" else dumped), dumped
    return kind, dumped


def open_sglang(path: Path, folder: Path) -> Source:
    files, skipped = [], 0
    for file in dump_files(folder):
        fields = parse_filename(file)
        value, meta = unwrap(load_pt(file))
        if not isinstance(value, torch.Tensor):
            skipped += 1  # the dumper also records ints, strings and dicts; there is nothing to compare
            continue
        files.append(_File(path=file, step=fields["step"], rank=fields["rank"], dump_index=fields["dump_index"],
                           name=fields["name"], meta=meta))
    several_steps = len({f.step for f in files}) > 1
    groups: dict[tuple[str, str], list[_File]] = {}
    seen: dict[tuple, int] = defaultdict(int)
    for file in sorted(files, key=lambda f: (f.rank, f.dump_index)):
        kind, name = logical_name(file.name)
        if several_steps:
            name = step_name(file.step, name)
        repeat = seen[(file.rank, kind, name)]
        seen[(file.rank, kind, name)] += 1
        groups.setdefault((kind, repeat_name(name, repeat)), []).append(file)
    entries = []
    for (kind, name), group in groups.items():
        first = min(group, key=lambda f: f.rank)
        layer = first.meta.get("layer_id")
        group = sorted(group, key=lambda f: f.rank)
        if kind == "param_grad":
            fc2 = groups.get((kind, _FC1.sub("linear_fc2.weight", name)), [])
            load = partial(_param_grad, group, name.rpartition("/")[2], partial(_gate_parts, fc2))
        else:
            load = partial(_loss if kind == "loss" else _reassemble, group)
        entries.append(Entry(kind=kind, name=name, order=(phase(kind), 0, first.dump_index),
                             layer=layer if isinstance(layer, int) else layer_of(name), load=load))
    ranks = len({f.rank for f in files})
    description = f"sglang dump: {len(files)} files, {ranks} rank(s)" + (
        f", {skipped} non-tensor values ignored" if skipped else "")
    return Source(path=Path(path), format="sglang", description=description, entries=entries)


def unwrap(content) -> tuple[object, dict]:
    """(value, meta) of a dumper file: {"value": v, "meta": {...}}, or a bare value."""
    if isinstance(content, dict) and "value" in content:
        meta = content.get("meta")
        return content["value"], meta if isinstance(meta, dict) else {}
    return content, {}


def _load(file: _File) -> torch.Tensor:
    value, _ = unwrap(load_pt(file.path))
    if not isinstance(value, torch.Tensor):
        raise UserError(f"{file.path}: no longer holds a tensor")
    return value


def _dims(file: _File) -> Optional[str]:
    dims = file.meta.get("dims")
    return dims if isinstance(dims, str) and dims.strip() else None


def _param_grad(files: list[_File], name: str, gate_parts: Callable[[list[torch.Tensor]], int]) -> Value:
    """A parameter gradient without dims (dump_model writes none): whole on every CP and DP rank,
    split over TP (over expert TP for experts) as megatron's parameter names say (dump/megatron_params)."""
    if len(files) == 1 or _dims(files[0]):
        return _reassemble(files)
    tensors = [_load(f) for f in files]
    axis = "etp" if ".experts." in name else "tp"
    try:
        infos = [{**_parallel_info(f), "rank": f.rank} for f in files]
        if axis == "etp" and any(info.get("ep_size", 1) != 1 for info in infos):
            raise ValueError("expert parameters are named by their index on their own EP rank")
        dim = tp_dim_by_name(name)
        splits = [] if dim is None or _coord(infos[0], axis)[1] == 1 else [
            _Split(dim=dim, axis=axis, zigzag=False, partial=False, parts=gate_parts(tensors) if gated_linear(name) else 1)]
        gaps: list[ReplicaGap] = []
        full = _merge(list(zip(infos, tensors)), splits, gaps)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        return Value(shape=list(tensors[0].shape), dtype=str(tensors[0].dtype).removeprefix("torch."),
                     problem=f"dumped by {len(files)} ranks without dims: {e}")
    value = tensor_value(full)
    value.replicas = gaps
    return value


def _gate_parts(fc2: list[_File], fc1: list[torch.Tensor]) -> int:
    """How many fused parts linear_fc1 holds: 2 (gate|up, SwiGLU) where its rows are twice the inputs
    of the layer's linear_fc2, 1 where they are as many."""
    if not fc2:
        raise ValueError("no linear_fc2 beside linear_fc1 to tell whether it holds gate|up fused")
    rows, inputs = fc1[0].shape[0], _load(fc2[0]).shape[-1]
    if rows not in (inputs, 2 * inputs):
        raise ValueError(f"linear_fc1's {rows} rows are neither linear_fc2's {inputs} inputs nor twice them")
    return rows // inputs


def _loss(files: list[_File]) -> Value:
    """The loss without dims: the same value on every rank is the loss reduced over them (as megatron
    reports it), checked as a replica; values that differ are per-rank parts whose reduction (a sum,
    a mean) the dump does not record: unverifiable, which is no divergence."""
    if len(files) == 1 or _dims(files[0]):
        return _reassemble(files)
    tensors = [_load(f) for f in files]
    if all(torch.equal(t, tensors[0]) for t in tensors[1:]):
        return tensor_value(tensors[0])
    return Value(shape=list(tensors[0].shape), dtype=str(tensors[0].dtype).removeprefix("torch."),
                 parts=torch.stack(tensors),
                 unverifiable=f"differs between its {len(files)} ranks, which dumped it without dims: per-rank "
                              "parts whose reduction (a sum or a mean over ranks) the dump does not record")


def _reassemble(files: list[_File]) -> Value:
    if len(files) == 1:
        return tensor_value(_load(files[0]))
    dims = _dims(files[0])
    if dims is None:
        first = _load(files[0])
        return Value(shape=list(first.shape), dtype=str(first.dtype).removeprefix("torch."),
                     problem=f"dumped by {len(files)} ranks without dims: shards and replicas cannot be told apart")
    try:
        splits = parse_dims(dims)
        infos = [{**_parallel_info(f), "rank": f.rank} for f in files]  # "rank": to name replicas that differ
        tensors = [_load(f) for f in files]
        if any(t.ndim != len(dims.split("#")[0].split()) for t in tensors):
            raise ValueError(f"dims {dims!r} do not match the tensor's {tensors[0].ndim} dims")
        gaps: list[ReplicaGap] = []
        full = _merge(list(zip(infos, tensors)), splits, gaps)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        # Foreign metadata: dims or parallel info of the wrong type, or shards that do not fit together.
        return Value(shape=[], dtype="?", problem=f"cannot reassemble from dims: {type(e).__name__}: {e}")
    value = tensor_value(full)
    value.replicas = gaps
    return value


def parse_dims(dims: str) -> list[_Split]:
    """The sharded axes of an sglang dims string, innermost first (the last one listed on a dim)."""
    splits = []
    for index, token in enumerate(dims.split("#")[0].split()):
        match = _MODIFIERS.match(token)
        if match is None:
            raise ValueError(f"bad dim {token!r}")
        for modifier in reversed((match.group("mods") or "").split(",") if match.group("mods") else []):
            axis, _, qualifiers = modifier.strip().partition(":")
            if axis not in _AXES:
                raise ValueError(f"axis {axis!r} is not supported (only {', '.join(_AXES)})")
            quals = set(qualifiers.split("+")) - {"", "sharded"}
            if quals - {"zigzag", "natural", "partial"}:
                raise ValueError(f"unknown qualifier in {modifier!r}")
            splits.append(_Split(dim=index, axis=axis, zigzag="zigzag" in quals, partial="partial" in quals))
    return splits


def _parallel_info(file: _File) -> dict:
    info = {**(file.meta.get("sglang_parallel_info") or {}), **(file.meta.get("megatron_parallel_info") or {})}
    if "sp_rank" not in info and "tp_rank" in info:  # megatron's sequence parallelism reuses the TP group
        info["sp_rank"], info["sp_size"] = info["tp_rank"], info.get("tp_size")
    return info


def _coord(info: dict, axis: str) -> tuple[int, int]:
    if f"{axis}_rank" not in info or f"{axis}_size" not in info:
        raise ValueError(f"a rank's parallel info has no {axis}_rank / {axis}_size")
    return info[f"{axis}_rank"], info[f"{axis}_size"]


def _merge(shards: list[tuple[dict, torch.Tensor]], splits: list[_Split], gaps: list[ReplicaGap]) -> torch.Tensor:
    """Undo the first split within every group of shards that agree on the other splits' ranks."""
    if not splits:
        return first_replica([(info["rank"], t) for info, t in shards], gaps)
    split, rest = splits[0], splits[1:]
    groups: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for info, tensor in shards:
        key = tuple(_coord(info, s.axis)[0] for s in rest)
        groups[key][_coord(info, split.axis)[0]].append((info, tensor))
    merged = []
    for by_rank in groups.values():
        size = _coord(next(iter(by_rank.values()))[0][0], split.axis)[1]
        if sorted(by_rank) != list(range(size)):
            raise ValueError(f"has {split.axis} ranks {sorted(by_rank)} of {size}")
        parts = [first_replica([(info["rank"], t) for info, t in by_rank[r]], gaps) for r in range(size)]
        merged.append((by_rank[0][0][0], _undo(split, parts)))
    return _merge(merged, rest, gaps)


def _undo(split: _Split, parts: list[torch.Tensor]) -> torch.Tensor:
    if split.partial:
        total = parts[0].to(torch.float64 if parts[0].is_floating_point() else parts[0].dtype, copy=True)
        for part in parts[1:]:
            total += part
        return total.to(parts[0].dtype)
    if split.zigzag:
        return merge_cp(parts, split.dim)
    return merge_tp(parts, split.dim, split.parts)
