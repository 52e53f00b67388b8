"""Dumps written by sglang's dumper (`sglang.srt.debug_utils.dumper`).

The dumper writes one `torch.save({"value": tensor, "meta": {...}})` file per tensor and rank,
named `step=S___rank=R___dump_index=N___name=X___...pt`, under `{dir}/{exp_name}/`; either folder
may be given. Files are read with torch.load(weights_only=True) only. sglang's earlier dumper named
files `forward_pass_id=F___rank=R___name=X___dump_index=N___...pt` and saved the bare tensor:
forward_pass_id is the step, the name's other tags its meta. Its earliest wrote neither rank nor
dump_index (one folder per rank): the order of the tensors is not recorded, and such files are refused.

Names map onto megalign's kinds: `grad__param__X` is the parameter gradient of X (dump_model),
`grad__X` the activation gradient of X, `non_intrusive__M.output` the output of module M (hook
mode), `input_ids` the tokens; anything else is an activation. With several steps, names get a
`stepS/` prefix; a name dumped again in one step gets `@1`, `@2`, ... Tags dumped beside a name
(`layer_id=3`) that tell its tensors apart join the name, and a recomputed copy is checked against
its original (sglang_identity.py).

A tensor dumped by several ranks is put back together from its `dims` (e.g. `s[cp:zigzag] b h[tp]`)
and each rank's `megatron_parallel_info` / `sglang_parallel_info`, which sglang_dims.py translates
into the splits and sums of a plan (compare/plan.py), carried out by compare/reassemble.py as for
megalign dumps: sharded dims in rank order (zigzag undone for `cp:zigzag`, summed for `partial`),
ranks that differ only in axes the dims do not shard hold replicas. Without dims, shards and replicas cannot be told apart: such tensors
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
from typing import Optional

import torch

from megalign.compare.entries import Entry, Source, Value, phase
from megalign.compare.plan import Holder, place
from megalign.compare.reassemble import execute, in_memory
from megalign.compare.sources.plain import is_regular, load_pt, tensor_files, tensor_value
from megalign.compare.sources.sglang_dims import (Sharded, non_empty, parallel_info, parse_dims, rank_coords,
                                                  sharded, split_on)
from megalign.compare.sources.sglang_identity import (Tags, checked_against_recompute, naming_tags, recomputed,
                                                      tagged, tags_of)
from megalign.compare.sources.sglang_thd import (BOUNDS, PACKING, packed_row, sequence_bounds, token_dim,
                                                 zigzag_on_tokens)
from megalign.compare.steps import step_name
from megalign.dump.format import Kind, layer_of, repeat_name
from megalign.dump.megatron_params import gated_linear, tp_dim_by_name
from megalign.dump.tensorfile import content_hash
from megalign.errors import UserError

_REQUIRED = ("step", "rank", "dump_index", "name")
# sglang's earlier dumper's tag for what is now the step (a forward pass).
_EARLIER_STEP = "forward_pass_id"
_FC1 = re.compile(r"linear_fc1\.(weight|bias)$")


@dataclass
class _File:
    path: Path
    step: int
    rank: int
    dump_index: int
    name: str
    meta: dict
    shape: tuple[int, ...]
    dtype: torch.dtype
    tags: Tags = ()
    recomputed: bool = False


def parse_filename(path: Path) -> Optional[dict]:
    fields = dict(part.split("=", 1) for part in path.stem.split("___") if "=" in part)
    if "step" not in fields and _EARLIER_STEP in fields:
        fields["step"] = fields[_EARLIER_STEP]
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
    folders = [d for d in sorted(path.iterdir()) if d.is_dir()]
    found = [d for d in folders if _has_dump_files(d)]
    if len(found) > 1:
        raise UserError(f"{path}: holds several sglang dumps ({', '.join(d.name for d in found)}): pass one of them")
    if not found:
        _refuse_earliest(path, folders)
    return found[0] if found else None


def _refuse_earliest(path: Path, folders: list[Path]) -> None:
    """sglang's earliest dumper's files (forward_pass_id and name only) would read as plain tensors
    named by their file, which match nothing: say why they are not read."""
    for folder in [path, *folders]:
        earliest = [f for f in tensor_files(folder) if f.suffix == ".pt" and f"{_EARLIER_STEP}=" in f.stem]
        if earliest:
            raise UserError(f"{earliest[0]}: sglang's earliest dumper naming (forward_pass_id and name, without "
                            "rank and dump_index) does not record the order the tensors were dumped in: dump "
                            "again with a later sglang, whose files name rank and dump_index")


def logical_name(dumped: str) -> tuple[str, str]:
    """(kind, name) in megalign's terms for a name as sglang's dumper wrote it."""
    if dumped.startswith("grad__param__"):
        return Kind.PARAM_GRAD, dumped.removeprefix("grad__param__")
    if dumped.startswith("param__"):
        return Kind.PARAM, dumped.removeprefix("param__")
    kind = Kind.ACTIVATION
    if dumped.startswith("grad__"):
        kind, dumped = Kind.ACTIVATION_GRAD, dumped.removeprefix("grad__")
    if dumped.startswith("non_intrusive__"):
        module, _, output = dumped.removeprefix("non_intrusive__").rpartition(".output")
        if module and output in ("", ".0"):
            return kind, module
        if module and output[1:].isdigit():
            return kind, f"{module}#{output[1:]}"  # megalign's name for a module's i-th output
        dumped = dumped.removeprefix("non_intrusive__")
    if kind == Kind.ACTIVATION:
        if dumped == "input_ids":
            return Kind.INPUT, "tokens"
        if dumped == "position_ids":
            return Kind.INPUT, dumped
        if dumped in (Kind.LOSS, Kind.LOGPROBS, Kind.LOGITS):  # each the one tensor of its kind
            return Kind(dumped), dumped
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
                           name=fields["name"], meta=meta or _tags(fields), shape=tuple(value.shape),
                           dtype=value.dtype, tags=tags_of(fields), recomputed=recomputed(fields)))
        _check_dims(files[-1])
    several_steps = len({f.step for f in files}) > 1
    # Each step's packed sequences, as its lowest rank recorded them (sglang_thd.py).
    bounds = {f.step: _load(f).tolist() for f in sorted(files, key=lambda f: -f.rank) if f.name == BOUNDS}
    groups: dict[tuple[str, str], list[_File]] = {}
    seen: dict[tuple, int] = defaultdict(int)
    naming = naming_tags([(f.name, f.tags) for f in files])
    for file in sorted(files, key=lambda f: (f.rank, f.dump_index)):
        if file.name in PACKING:
            continue
        kind, name = logical_name(file.name)
        name = tagged(name, file.tags, naming[file.name])
        if several_steps:
            name = step_name(file.step, name)
        # A recomputed copy is counted apart: it joins its original's group (sglang_identity.py).
        repeat = seen[(file.rank, kind, name, file.recomputed)]
        seen[(file.rank, kind, name, file.recomputed)] += 1
        groups.setdefault((kind, repeat_name(name, repeat)), []).append(file)
    entries = []
    for (kind, name), group in groups.items():
        first = min(group, key=lambda f: f.rank)
        layer = first.meta.get("layer_id")
        group = sorted(group, key=lambda f: f.rank)
        if kind == Kind.PARAM_GRAD:
            fc2 = groups.get((kind, _FC1.sub("linear_fc2.weight", name)), [])
            load = partial(_param_grad, group, name.rpartition("/")[2], fc2)
        else:
            load = partial(_with_recompute, group,
                           _loss if kind == Kind.LOSS else partial(_reassemble, bounds=bounds.get(first.step)))
        entries.append(Entry(kind=kind, name=name, order=(phase(kind), 0, first.dump_index),
                             layer=layer if isinstance(layer, int) else layer_of(name), load=load,
                             **_packing(_dims(first), bounds.get(first.step))))
    ranks = len({f.rank for f in files})
    description = f"sglang dump: {len(files)} files, {ranks} rank(s)" + (
        f", {skipped} non-tensor values ignored" if skipped else "")
    return Source(path=Path(path), format="sglang", description=description, entries=entries)


def _packing(dims: Optional[str], bounds: Optional[list[int]]) -> dict:
    """An entry's dims, and where they name a token dim of a step with packed sequences, that dim as its
    step's one packed row (sglang_thd.py)."""
    tokens = None if dims is None else token_dim(dims)
    if tokens is None or bounds is None:
        return {"dims": dims}
    return {"dims": dims, "seq_dim": tokens, "packed": True, "rows": packed_row(bounds)}


def unwrap(content) -> tuple[object, dict]:
    """(value, meta) of a dumper file: {"value": v, "meta": {...}}, or a bare value."""
    if isinstance(content, dict) and "value" in content:
        meta = content.get("meta")
        return content["value"], meta if isinstance(meta, dict) else {}
    return content, {}


def _tags(fields: dict) -> dict:
    """The meta of an earlier dumper's file, which saved the bare tensor: its name's tags (layer_id=3 ...)."""
    return {key: int(value) if value.isdigit() else value for key, value in fields.items() if isinstance(value, str)}


def _check_dims(file: _File) -> None:
    """Dims that break sglang's grammar (an unknown axis or word after `#`, a typo) are bad input."""
    dims = _dims(file)
    if dims is not None:
        try:
            parse_dims(dims)
        except ValueError as e:
            raise UserError(f"{file.path}: dims {dims!r}: {e}") from None


def _with_recompute(files: list[_File], load) -> Value:
    """The tensor as `load` puts it together from the original files, its recomputed copy (if any)
    checked against it."""
    original = [f for f in files if not f.recomputed]
    copy = [f for f in files if f.recomputed]
    if not original or not copy:
        return load(files)
    return checked_against_recompute(load(original), load(copy))


def _load(file: _File) -> torch.Tensor:
    value, _ = unwrap(load_pt(file.path))
    if not isinstance(value, torch.Tensor):
        raise UserError(f"{file.path}: no longer holds a tensor")
    return value.detach()  # sglang's dumper saves activations that required grad as they were


def _dims(file: _File) -> Optional[str]:
    dims = file.meta.get("dims")
    return dims if isinstance(dims, str) and dims.strip() else None


def _param_grad(files: list[_File], name: str, fc2: list[_File]) -> Value:
    """A parameter gradient without dims (dump_model writes none): whole on every CP and DP rank,
    split over TP (over expert TP for experts) as megatron's parameter names say (dump/megatron_params)."""
    if len(files) == 1 or _dims(files[0]):
        return _reassemble(files)
    axis = "etp" if ".experts." in name else "tp"
    try:
        infos = [parallel_info(f.meta) for f in files]
        if axis == "etp" and any(info.get("ep_size", 1) != 1 for info in infos):
            raise ValueError("expert parameters are named by their index on their own EP rank")
        parts = _gate_parts(fc2, files[0].shape) if gated_linear(name) else 1
        return _assembled(files, infos, split_on(infos, axis, tp_dim_by_name(name), parts))
    except ValueError as e:  # Unassemblable among them
        return Value(shape=list(files[0].shape), dtype=_dtype_name(files[0].dtype),
                     problem=f"dumped by {len(files)} ranks without dims: {e}")


def _gate_parts(fc2: list[_File], fc1: tuple[int, ...]) -> int:
    """How many fused parts linear_fc1 holds: 2 (gate|up, SwiGLU) where its rows are twice the inputs
    of the layer's linear_fc2, 1 where they are as many."""
    if not fc2:
        raise ValueError("no linear_fc2 beside linear_fc1 to tell whether it holds gate|up fused")
    rows, inputs = fc1[0], fc2[0].shape[-1]
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
    return Value(shape=list(tensors[0].shape), dtype=_dtype_name(tensors[0].dtype), parts=torch.stack(tensors),
                 unverifiable=f"differs between its {len(files)} ranks, which dumped it without dims: per-rank "
                              "parts whose reduction (a sum or a mean over ranks) the dump does not record")


def _reassemble(files: list[_File], bounds: Optional[list[int]] = None) -> Value:
    """`bounds`: the step's packed sequences' (cu_seqlens_q), where it recorded them (sglang_thd.py)."""
    if len(files) == 1:
        return tensor_value(_load(files[0]))
    dims = _dims(files[0])
    if dims is None:
        return Value(shape=list(files[0].shape), dtype=_dtype_name(files[0].dtype),
                     problem=f"dumped by {len(files)} ranks without dims: shards and replicas cannot be told apart")
    try:
        parsed = parse_dims(dims)
        if any(len(f.shape) != parsed.ndim for f in files):
            raise ValueError(f"dims {dims!r} do not match the tensor's {len(files[0].shape)} dims")
        infos = [parallel_info(f.meta) for f in files]
        kept = non_empty(parsed, infos, [f.shape for f in files])
        if len(kept) == 1:
            return tensor_value(_load(files[kept[0]]))
        files, infos = [files[i] for i in kept], [infos[i] for i in kept]
        split = sharded(parsed, infos)
        zigzag = zigzag_on_tokens(dims)
        cp = next((s.size for s in split.splits if s.zigzag), 1)
        packed = None if zigzag is None or cp == 1 else sequence_bounds(bounds, files[0].shape[zigzag] * cp, cp)
        return _assembled(files, infos, split, packed)
    except (ValueError, RuntimeError) as e:  # foreign dims or parallel info, or shards that do not fit (Unassemblable)
        return Value(shape=[], dtype="?", problem=f"cannot reassemble from dims: {type(e).__name__}: {e}")


def _assembled(files: list[_File], infos: list[dict], split: Sharded,
               bounds: Optional[tuple[int, ...]] = None) -> Value:
    """The tensor put together by its plan; the first rank (in rank order) of each place is placed, the
    others are its replicas; `bounds`: where its zigzag split is undone sequence by sequence. Each shard's
    bytes are hashed, as megalign's run hashes them, so that a bit-identical replica has no gap, as in a
    megalign dump."""
    tensors = {f.rank: _load(f) for f in files}
    ordered = sorted(zip(files, infos), key=lambda pair: pair[0].rank)
    plan = place([Holder(coords=rank_coords(f.rank, info), at=split.at(info), shape=f.shape,
                         digest=(content_hash(tensors[f.rank].contiguous()), str(f.dtype)), bounds=bounds)
                  for f, info in ordered], split.splits, split.summed)
    first = tensors[plan.pieces[0].coords.rank]
    value = Value(shape=list(plan.shape), dtype=_dtype_name(first.dtype))
    return execute(plan, in_memory(lambda coords: tensors[coords.rank]), value, first.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
