"""megalign dumps: one Entry per (kind, name), reassembled from all ranks that hold it."""

from __future__ import annotations

import gc
import math
from functools import partial
from pathlib import Path
from typing import Optional

from megalign.compare.entries import Entry, Source, phase
from megalign.compare.plan import RankRecord, full_shape
from megalign.compare.reassemble import reassemble
from megalign.compare.steps import step_name, step_order
from megalign.dump.format import Kind, TensorRecord, repeat_name
from megalign.dump.layout import Layout
from megalign.dump.meta import EXPERT_BIAS_UPDATE
from megalign.dump.reader import DumpFiles
from megalign.dump.tensorfile import STORED_DTYPES
from megalign.errors import is_int, is_number


def open_megalign(path: Path) -> Source:
    # A real dump's manifests make hundreds of thousands of small objects at once, and the cyclic
    # collector, run again and again while they pile up, took longer than the parsing itself (both
    # sides of the real TP=1/TP=3 pair: 0.28 s with it, 0.08 s without, measured). Cycles made
    # meanwhile, if any, are collected once it is back on.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _open(path)
    finally:
        if collecting:
            gc.enable()


def _open(path: Path) -> Source:
    dump = DumpFiles.open(path)
    groups: dict[tuple[str, str], list[RankRecord]] = {}
    dumped = _steps(dump.meta)
    several = len(dumped) > 1
    steps: dict[tuple[str, str], Optional[int]] = {}  # each entry's step, where the dump records steps
    rows: dict[tuple[str, str], Optional[list]] = {}  # where its steps' rows differ: each entry's step's
    for rank in dump.ranks:
        stepped = [_step(rank.extra.get("steps"), record.order) if dumped else None for record in rank.records]
        labels = [record.name if step is None or not several else step_name(step, record.name)
                  for record, step in zip(rank.records, stepped)]
        for record, step, name in zip(rank.records, stepped, _repeats(rank.records, labels)):
            groups.setdefault((record.kind, name), []).append(RankRecord(rank, record))
            steps[(record.kind, name)] = step
            rows[(record.kind, name)] = dump.rows_at(step) if dump.step_rows else None
    meta = dump.meta
    entries = [_entry(dump, kind, name, shards, steps[(kind, name)], several, rows[(kind, name)])
               for (kind, name), shards in groups.items()]
    description = (f"megalign dump: {meta.get('stack', '?')} {meta.get('mode', '?')}, {dump.layout.describe()}"
                   + f", {meta.get('dtype', '?')}"
                   + (", packed" if meta.get("packed") else "")
                   + (", zoomed: values of the tensors --dump-only chose, stats of the rest" if meta.get("dump_only")
                      else ", stats only" if meta.get("stats_only") else "")
                   + _bias_update(meta.get(EXPERT_BIAS_UPDATE)))
    return Source(path=Path(path), format="megalign", description=description, entries=entries,
                  precision=meta.get("dtype"), model=meta.get("model") if isinstance(meta.get("model"), dict) else None,
                  weights=_weights(meta), rows=dump.rows, dump=dump, stack=meta.get("stack"),
                  kernel=_kernel(meta, dump.layout), rows_unknown=meta.get("rows_unknown"), steps=dumped or None)


def _repeats(records: list[TensorRecord], labels: list[str]) -> list[str]:
    """Each record's name: its label, with @1, @2, ... where a module called twice per step dumped its
    label again. The repeats are numbered in the order of the forward calls: an activation gradient's
    call, not when backward reached it (two micro-batches in one backward reach the second first)."""
    calls: dict[tuple[str, str], list[int]] = {}
    for index, (record, label) in enumerate(zip(records, labels)):
        calls.setdefault((record.kind, label), []).append(index)
    names = list(labels)
    for indices in calls.values():
        if len(indices) > 1:
            indices.sort(key=lambda i: _called(records[i]))
            for repeat, index in enumerate(indices):
                names[index] = repeat_name(labels[index], repeat)
    return names


def _called(record: TensorRecord) -> int:
    return record.order if record.call is None else record.call


def _steps(meta: dict) -> list[int]:
    """The steps a Dumper's dump.json lists (none for a megalign run's)."""
    steps = meta.get("steps")
    return [n for n in steps if is_int(n)] if isinstance(steps, list) else []


def _bias_update(rate) -> str:
    """What a dump whose routers moved their expert_bias says of it: a run that keeps the bias (transformers
    never moves e_score_correction_bias) routes otherwise from the second step on, by design."""
    if not is_number(rate) or not rate > 0:
        return ""
    return (f", its routers' expert_bias moved after every step (megatron's finalize_model_grads, "
            f"moe_router_bias_update_rate {rate:g}): from the second step on it routes otherwise than a run that keeps "
            "the bias (transformers)")


def _kernel(meta: dict, layout: Layout) -> str:
    """The attention kernel as far as dump.json tells. `auto` picks by device (TE on CUDA where it is
    installed), then megatron's local attention at CP=1 unpacked and megalign's otherwise (docs/running.md)."""
    attention = meta.get("attention")
    if attention != "auto":
        return str(attention)
    local = layout.cp == 1 and not meta.get("packed")
    return f"auto: {'local' if local else 'megalign'} on {meta.get('device')}"


def _weights(meta: dict) -> Optional[str]:
    """A checkpoint's weights, or random ones, which the seed makes (dropout is off: it seeds nothing else)."""
    if meta.get("hf_checkpoint"):
        return "a checkpoint"
    return f"seed {meta['seed']}" if meta.get("seed") is not None else None


def _step(marks: Optional[list], order: int) -> Optional[int]:
    """The step a record was written in, from its manifest's [step, first record] marks (Dumper)."""
    found = None
    for mark in marks if isinstance(marks, list) else []:
        if isinstance(mark, list) and len(mark) == 2 and all(map(is_int, mark)) and order >= mark[1]:
            found = mark[0]
    return found


def _entry(dump: DumpFiles, kind: str, name: str, shards: list[RankRecord], step: Optional[int], several: bool,
           rows: Optional[list]) -> Entry:
    """An entry of a dump; where it holds several steps, ordered by step first."""
    record = shards[0].record
    shape = full_shape(shards, dump.layout)
    itemsize = STORED_DTYPES[record.dtype].itemsize
    order = step_order(step) if several else ()
    return Entry(kind=kind, name=name, order=order + _order(shards[0]), layer=record.layer, step=step,
                 load=partial(reassemble, dump, shards),
                 shape=shape, dtype=record.dtype, batch_dim=record.sharding.dp_dim, seq_dim=record.sharding.seq_dim,
                 nbytes=None if record.file is None else math.prod(shape) * itemsize, shards=shards, rows=rows)


def _order(shard: RankRecord) -> tuple:
    """Every PP stage counts its records from 0: forward runs through the stages in ascending
    order, the backward in descending order."""
    stage = shard.rank.coords.pp_rank
    kind = shard.record.kind
    return phase(kind), -stage if kind == Kind.ACTIVATION_GRAD else stage, shard.record.order
