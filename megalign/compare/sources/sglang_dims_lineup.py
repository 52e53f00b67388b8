"""Two sides' sglang dims that name the same dims laid out differently, brought to one shape by their names.

As sglang's comparator does it (aligner/axis_aligner.py), after each side is put back together and
before the pair is judged: a squeeze dim `1` is dropped; a dim fused on one side (`(a*b)`) and
separate on the other (`a b`) is flattened on the separate side, in the fused side's order; the dims
then follow B's order, `s` and `t` naming the same dim. Sides whose names differ otherwise, or fuse
the same names in different groups or orders, are compared as they are.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Optional

import torch

from megalign.compare.entries import Entry, Source, Value

SQUEEZE = "1"
_SAME = {"s": "t"}  # sglang's seq and token dims: one dim
_BRACKETS = re.compile(r"\[[^\]]*\]$")


def dim_names(dims: str) -> list[tuple[str, ...]]:
    """Each dim's names: () for a squeeze dim, the sub-dims of a fused one, else its name alone."""
    names = []
    for token in dims.split("#")[0].split():
        bare = _BRACKETS.sub("", token)
        if bare == SQUEEZE:
            names.append(())
        else:
            names.append(tuple(_SAME.get(n.strip(), n.strip()) for n in bare.strip("()").split("*")))
    return names


@dataclass(frozen=True)
class Arrangement:
    """How one side's tensor reaches the shape both share: squeezed dims dropped, the rest permuted,
    then each run of `merged[i]` consecutive dims flattened into the i-th dim."""

    squeezed: tuple[int, ...]
    order: tuple[int, ...]
    merged: tuple[int, ...]

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        if any(tensor.shape[d] != 1 for d in self.squeezed):
            raise ValueError(f"squeeze dim of size {[tensor.shape[d] for d in self.squeezed]}, not 1")
        tensor = tensor.squeeze(self.squeezed) if self.squeezed else tensor
        tensor = tensor.permute(self.order)
        sizes, start = [], 0
        for count in self.merged:
            sizes.append(math.prod(tensor.shape[start:start + count]))
            start += count
        return tensor.reshape(sizes)


def arrangements(a: str, b: str) -> Optional[tuple[Optional[Arrangement], Optional[Arrangement]]]:
    """Each side's arrangement (None: already in the shared shape), or None where the names do not line up."""
    sides = [dim_names(a), dim_names(b)]
    flat = [sorted(n for group in side for n in group) for side in sides]
    if flat[0] != flat[1] or len(set(flat[0])) != len(flat[0]):
        return None
    fused: dict[str, tuple[str, ...]] = {}
    for group in (g for side in sides for g in side if len(g) > 1):
        for name in group:
            if fused.setdefault(name, group) != group:
                return None
    canonical, seen = [], set()
    for group in sides[1]:
        if group and group[0] not in seen:
            canonical.append(fused.get(group[0], group))
            seen.update(canonical[-1])
    found = [_arrangement(side, canonical) for side in sides]
    return None if found == [None, None] else (found[0], found[1])


def _arrangement(side: list[tuple[str, ...]], canonical: list[tuple[str, ...]]) -> Optional[Arrangement]:
    squeezed = tuple(d for d, group in enumerate(side) if not group)
    kept = [group for group in side if group]
    order, merged = [], []
    for group in canonical:
        if group in kept:
            order.append(kept.index(group))
            merged.append(1)
        else:  # separate on this side: its dims side by side, in the fused order
            order += [kept.index((name,)) for name in group]
            merged.append(len(group))
    if not squeezed and order == sorted(order) and set(merged) == {1}:
        return None
    return Arrangement(squeezed=squeezed, order=tuple(order), merged=tuple(merged))


def line_up_dims(a: Source, b: Source) -> tuple[Source, Source]:
    """The sources with each tensor that both sides dumped with dims brought to one shape by the names."""
    dims = [{(e.kind, e.name): e.dims for e in s.entries if e.dims} for s in (a, b)]
    plans = {key: arrangements(dims[0][key], dims[1][key]) for key in dims[0].keys() & dims[1].keys()}

    def lined(source: Source, side: int) -> Source:
        entries = []
        for entry in source.entries:
            plan = plans.get((entry.kind, entry.name))
            arrangement = plan[side] if plan else None
            entries.append(entry if arrangement is None else
                           replace(entry, load=_arranged(entry, arrangement), shape=None, nbytes=None))
        return replace(source, entries=entries)

    return lined(a, 0), lined(b, 1)


def _arranged(entry: Entry, arrangement: Arrangement):
    def load() -> Value:
        value = entry.load()
        if value.problem or value.tensor is None:
            return value
        if value.tensor.ndim != len(dim_names(entry.dims)):
            return value  # lined up by tokens already (lineup.py): its dims are no longer these
        try:
            tensor = arrangement.apply(value.tensor)
        except (ValueError, RuntimeError) as e:
            return replace(value, problem=f"cannot line its dims {entry.dims!r} up with the other side's: {e}")
        return replace(value, shape=list(tensor.shape), tensor=tensor)

    return load
