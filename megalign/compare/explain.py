"""`megalign compare A [B] --explain NAME`: how a tensor is put back together in each input, rank by
rank (its plan, plan.py), without comparing anything."""

from __future__ import annotations

import difflib
from pathlib import Path

from megalign.compare.entries import Entry, Source
from megalign.compare.plan import Unassemblable
from megalign.compare.reassemble import plan_of
from megalign.compare.sources import open_source
from megalign.errors import UserError


def near_names(name: str, names) -> list[str]:
    """The names closest to one that is not there, closest first (at most three)."""
    return difflib.get_close_matches(name, sorted(set(names)), n=3)


def explain(paths: list[tuple[str, Path]], name: str) -> list[str]:
    """The lines `--explain NAME` prints for the (label, path) inputs, opened in their order: each
    input's description, then the plan of every kind of tensor it holds under NAME. UserError (exit 2)
    when no input holds NAME: one line naming the closest names."""
    inputs = [(label, path, open_source(path)) for label, path in paths]
    if not any(entry.name == name for _, _, source in inputs for entry in source.entries):
        labels = " or ".join(label for label, _, _ in inputs)
        close = near_names(name, (e.name for _, _, source in inputs for e in source.entries))
        hint = f"near names: {', '.join(close)}" if close else "no name is near it"
        raise UserError(f"--explain: no tensor {name!r} in {labels}; {hint}")
    lines = []
    for label, path, source in inputs:
        lines.append(f"{label} {path}: {source.description}")
        entries = sorted((e for e in source.entries if e.name == name), key=lambda e: e.order)
        if not entries:
            lines.append(f"  holds no {name}")
        for entry in entries:
            first, *rest = _plan_lines(source, entry)
            lines += [f"  {entry.kind or 'tensor'} {name}: {first}", *(f"  {line}" for line in rest)]
    return lines


def _plan_lines(source: Source, entry: Entry) -> list[str]:
    if entry.shards is None:  # no rank records: nothing for megalign to plan
        return [f"read as the {source.format} input holds it"
                + (" (its files' dims say how ranks are put together)" if source.format == "sglang" else "")]
    try:
        return plan_of(source.dump, entry.shards).explain()
    except Unassemblable as e:
        return [f"cannot be put back together: it {e}"]
