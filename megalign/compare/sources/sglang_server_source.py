"""An sglang server's dump as a `Source` that `megalign compare` lines up with a megalign run of the same tokens.

The passes are cut by request and position (sglang_server.py); every per-token tensor (one row per
token of every pass that dumped it) is lined up as [sequence, position, ...] and named as megalign
names it (sglang_names.py); a tensor its user dumped by hand (`dumper.dump(name, ...)`, not a module
hook's) keeps its name. The rows are one per request, without padding, and `tokens_only` makes
compare line both sides up by their real tokens even where a megalign run's rows look the same.
The logits processor's next-token logits (one row per request a pass, at its last token in the pass)
are compared at those tokens only (Entry.tokens). Hooked modules' tensors with no megalign name are
left out, and counted in the description.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from megalign.compare.entries import Entry, Source, Value
from megalign.compare.sources.plain import tensor_value
from megalign.compare.sources.sglang import dump_files, logical_name, parse_filename
from megalign.compare.sources.sglang_names import PER_REQUEST, Target, megatron_name
from megalign.compare.sources.sglang_server import CORE, ServerDump, fill_prefixes, open_server_dump
from megalign.dump.format import Kind, layer_of
from megalign.dump.layout import BatchRow
from megalign.errors import UserError

INPUTS = {"input_ids": "tokens", "positions": "position_ids"}
FORWARD_BATCH = (*CORE, "req_pool_indices")  # the forward batch's fields that the server's dumper writes
HOOKED = "non_intrusive__"  # the dumper's module hooks' names: sglang's module names, mapped to megalign's


def is_server_dump(folder: Path) -> bool:
    """A server's dumper writes the forward batch's `seq_lens` every pass; a training run's never does."""
    return any(parse_filename(f)["name"] == "seq_lens" for f in dump_files(folder))


def open_server(path: Path, folder: Path) -> Source:
    dump = open_server_dump(folder)
    why = fill_prefixes(dump)
    if why:
        raise UserError(f"{folder}: {why}")
    hooked = {logical_name(d)[1]: d for d in dump.order if d.startswith(HOOKED)}  # sglang's name -> the dumped one
    by_target: dict[Target, list[str]] = defaultdict(list)  # a megalign record -> the dumped names it is made of
    entries, left_out = [], []
    for dumped in sorted(dump.order, key=dump.order.get):
        target = _target(dump, dumped, hooked)
        per_request = PER_REQUEST.get(logical_name(dumped)[1]) if _per_request(dump, dumped) else None
        if target is not None:
            by_target[target].append(dumped)
        elif per_request is not None:
            entries.append(_at_ends(dump, dumped, per_request))
        elif dumped not in FORWARD_BATCH:
            left_out.append(dumped)
    for target, names in list(by_target.items()):
        if target.summed and len(names) == 1:  # a layer's output without its residual: not megatron's
            left_out += by_target.pop(target)
    entries += [Entry(kind=target.kind, name=target.name, order=(0, 0, dump.order[names[0]]),
                      layer=layer_of(target.name), load=partial(_lined_up, dump, names, target, hooked),
                      batch_dim=0, seq_dim=1) for target, names in by_target.items()]
    lengths = [len(r.tokens) for r in dump.requests]
    description = (f"sglang server dump: {len(dump.steps)} passes, {len(dump.requests)} requests, {sum(lengths)} "
                   f"tokens" + (f", {len(left_out)} tensors without a megalign name left out"
                                if left_out else ""))
    return Source(path=Path(path), format="sglang-server", description=description, entries=entries,
                  rows=[BatchRow(bounds=(0, max(lengths)), lengths=(n,)) for n in lengths], stack="sglang",
                  tokens_only=True)


def _target(dump: ServerDump, dumped: str, hooked: dict[str, str]) -> Optional[Target]:
    """The megalign record of a dumped per-token tensor."""
    if dumped in INPUTS:
        return Target(INPUTS[dumped], Kind.INPUT)
    if dumped in FORWARD_BATCH or not _per_token(dump, dumped):
        return None
    name = logical_name(dumped)[1]
    if not dumped.startswith(HOOKED):
        return Target(name)  # named by the dumper.dump call that wrote it: the name its user compares
    target = megatron_name(name)
    if target is not None and target.weights is not None and not _topk_ids(dump, dumped, hooked.get(target.weights)):
        return None  # a topk its MoE backend bypassed or packed otherwise (hidden states and logits, gather indexes)
    return target


def _topk_ids(dump: ServerDump, ids: str, weights: Optional[str]) -> bool:
    """`ids` are a StandardTopKOutput's expert ids: integers, [tokens, k], beside weights of the same shape."""
    first = dump.first(ids)
    return (not first.is_floating_point() and first.ndim == 2 and weights is not None
            and dump.first(weights).shape == first.shape and dump.first(weights).is_floating_point())


def _per_request(dump: ServerDump, name: str) -> bool:
    """Dumped as one row per request of the pass (and not per token), in every pass that dumped it."""
    values = [(step, v[name]) for step, v in dump.steps.items() if name in v]
    return name not in FORWARD_BATCH and not _per_token(dump, name) and all(
        isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == len(dump.steps[step]["rids"])
        for step, value in values)


def _at_ends(dump: ServerDump, name: str, kind: str) -> Entry:
    try:
        tokens, rows = dump.at_ends(name)
        load = partial(tensor_value, rows)
    except UserError as e:  # a pass without it: the row cannot be put together, which fails
        tokens, load = None, partial(Value, shape=[], dtype="?", problem=str(e))
    return Entry(kind=kind, name=kind, order=(0, 0, dump.order[name]), layer=None, tokens=tokens, load=load)


def _per_token(dump: ServerDump, name: str) -> bool:
    """Dumped as one row per token of the pass, in every pass that dumped it."""
    values = [(step, v[name]) for step, v in dump.steps.items() if name in v]
    return all(isinstance(value, torch.Tensor) and value.ndim >= 1 and
               value.shape[0] == dump.steps[step]["input_ids"].numel() for step, value in values)


def _lined_up(dump: ServerDump, names: list[str], target: Target, hooked: dict[str, str]) -> Value:
    """The sum of the dumped tensors (one, or a layer's MLP output and residual) as [sequence, position, ...]:
    a fused projection's tail past its first part's width, expert ids sorted by their weights."""
    try:
        value = sum(dump.lined_up(name) for name in names)
        if target.after is not None:
            value = value[..., dump.first(_companion(dump, target.after, hooked)).shape[-1]:]
        if target.weights is not None:
            order = dump.lined_up(_companion(dump, target.weights, hooked)).sort(dim=-1, descending=True, stable=True)
            value = value.gather(-1, order.indices)
        return tensor_value(value)
    except UserError as e:
        return Value(shape=[], dtype="?", problem=str(e))


def _companion(dump: ServerDump, name: str, hooked: dict[str, str]) -> str:
    if name not in hooked:
        raise UserError(f"{dump.folder}: no {name!r} dumped, which the comparison needs beside it")
    return hooked[name]
