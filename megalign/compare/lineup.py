"""Lining up runs whose batches are laid out differently: packed (THD) rows against padded ones.

When the sources' rows differ, every token tensor (one with a batch dim and a sequence dim) is
mapped to its real tokens, document by document in order: [tokens, ...]. Both sides then hold the
same tokens in the same order, whatever the packing and the padding, and compare as usual. A tensor
with a sequence dim and no batch dim (the RoPE table: positions, not tokens) cannot be mapped, but for
one that holds the batch's one packed row (Entry.packed: an sglang THD `t` dim); it
is set apart, with the reason, instead of failing as a shape mismatch; so is one with a batch dim
that holds the rows' length on a dim not recorded as its sequence dim (or on a second dim beside
it). A dump of several steps may hold each step's rows (a Dumper's step_rows, dynamic padding):
each tensor is lined up by its own step's. Where a dump's rows were not recorded (rows_unknown), a
token tensor shaped unlike the other side's is set apart with the reason. A tensor that one side holds
at some of the real tokens only (an sglang server's next-token logits: Entry.tokens) is compared at
those tokens: the other side's is cut to them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from megalign.compare.entries import Entry, Source, Value
from megalign.dump.layout import BatchRow, at_real_tokens

APART = "a sequence dim without a batch dim: not lined up between differently packed or padded batches"
APART_UNKNOWN = "a token tensor of a dump whose rows were not recorded, shaped unlike the other side's"
UNLINED_STATS = "stats only: no values to line up the real tokens of packed and padded rows"
APART_UNNAMED = ("a batch dim and the rows' length on a dim not recorded as the sequence dim (attention "
                 "weights [batch, heads, seq, seq]): not lined up between differently packed or padded batches")


def line_up(*sources: Optional[Source]) -> list[Optional[Source]]:
    """The sources with token tensors mapped to real tokens where their rows differ; else unchanged."""
    present = [s for s in sources if s is not None]
    # (kind, name) -> (the rows it was made from, the entry), a side each: rows differ from step to step.
    rows = {id(s): {(e.kind, e.name): (s.rows if e.rows is None else e.rows, e) for e in s.entries} for s in present}
    tokens_only = any(s.tokens_only for s in present)
    unknown = next((f"{s.path}: {s.rows_unknown}" for s in present if s.rows_unknown), None)

    def lined(entry: Entry, own: Optional[list[BatchRow]]) -> Entry:
        sides = [side[(entry.kind, entry.name)] for side in rows.values() if (entry.kind, entry.name) in side]
        if any(r is None for r, _ in sides):  # a side whose format does not say (or whose rows were lost)
            differ = unknown and entry.seq_dim is not None and any(e.shape != entry.shape for _, e in sides)
            return replace(entry, apart=f"{APART_UNKNOWN} ({unknown})") if differ else entry
        if all(r == own for r, _ in sides) and not tokens_only:
            return entry  # the same batch on every side: nothing to map
        return _line_up(entry, own, sides)

    lined_up = [None if s is None else replace(s, entries=[lined(e, rows[id(s)][(e.kind, e.name)][0])
                                                          for e in s.entries]) for s in sources]
    return [None if s is None else _cut_to_tokens(s, [o for o in lined_up if o is not None and o is not s])
            for s in lined_up]


def _cut_to_tokens(source: Source, others: list[Source]) -> Source:
    """The source with each tensor that another side holds at some real tokens only cut to those tokens."""
    some = {(e.kind, e.name): e.tokens for other in others for e in other.entries if e.tokens is not None}
    if not some:
        return source

    def cut(entry: Entry, tokens: list[int]) -> Entry:
        def load() -> Value:
            value = entry.load()
            if value.problem or value.tensor is None:
                return value
            if max(tokens) >= value.tensor.shape[0]:
                return replace(value, problem=f"holds {value.tensor.shape[0]} tokens; the other side has token "
                                              f"{max(tokens)}")
            tensor = value.tensor[torch.tensor(tokens, device=value.tensor.device)]
            return replace(value, shape=list(tensor.shape), tensor=tensor)

        return replace(entry, load=load, shape=None, nbytes=None)

    return replace(source, entries=[cut(e, some[(e.kind, e.name)]) if (e.kind, e.name) in some and e.tokens is None
                                    else e for e in source.entries])


def _line_up(entry: Entry, rows: list[BatchRow], sides: list[tuple[list[BatchRow], Entry]]) -> Entry:
    """The entry mapped to its real tokens, or set apart; `sides`: every side's (rows, entry) of it."""
    if entry.batch_dim is not None and _positions(entry, sides):
        return replace(entry, apart=APART_UNNAMED)
    if entry.packed and len(rows) == 1:
        def load() -> Value:
            value = entry.load()
            if value.tensor is not None and not value.problem:
                value = replace(value, tensor=value.tensor[None], shape=[1, *value.shape])
            return real_tokens(value, 0, entry.seq_dim + 1, rows)

        return replace(entry, load=load, shape=None, nbytes=None)
    if entry.batch_dim is not None and entry.seq_dim is not None:
        def load() -> Value:
            return real_tokens(entry.load(), entry.batch_dim, entry.seq_dim, rows)

        shape = None
        if entry.shape is not None:
            rest = [size for dim, size in enumerate(entry.shape) if dim not in (entry.batch_dim, entry.seq_dim)]
            shape = [sum(sum(row.lengths) for row in rows), *rest]
        return replace(entry, load=load, shape=shape, nbytes=None, lined_up=rows)
    if entry.seq_dim is not None:
        return replace(entry, apart=APART)
    return entry


def _positions(entry: Entry, sides: list[tuple[list[BatchRow], Entry]]) -> bool:
    """Whether a dim of the entry other than its batch and sequence dims holds, on every side, that
    side's rows' length: positions (attention weights [batch, heads, seq, seq]), which no token map
    lines up. A features dim that equals one side's length only (k_proj's 16 outputs against rows
    padded to 16 and to 12) is not one."""
    shapes = [(e.shape, r[0].bounds[-1]) for r, e in sides]
    if any(shape is None or len(shape) != len(entry.shape or ()) for shape, _ in shapes):
        return False
    return any(all(shape[dim] == length for shape, length in shapes)
               for dim in range(len(entry.shape)) if dim not in (entry.batch_dim, entry.seq_dim))


def real_tokens(value: Value, batch_dim: int, seq_dim: int, rows: list[BatchRow]) -> Value:
    """[..., rows, ..., seq, ...] -> [tokens, ...]: the real tokens of every document, in order."""
    if value.problem:
        return value
    if value.tensor is None:
        return replace(value, problem=UNLINED_STATS)
    if value.tensor.ndim <= max(batch_dim, seq_dim) or \
            (value.tensor.shape[batch_dim], value.tensor.shape[seq_dim]) != (len(rows), rows[0].bounds[-1]):
        return replace(value, problem=f"shape {list(value.tensor.shape)} does not hold the dump's {len(rows)} rows "
                                      f"of {rows[0].bounds[-1]} tokens")
    tensor = at_real_tokens(value.tensor, batch_dim, seq_dim, rows)
    return replace(value, shape=list(tensor.shape), tensor=tensor)

