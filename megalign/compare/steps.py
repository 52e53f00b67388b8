"""Lining up two dumps of a training loop's steps (a Dumper's `steps=`): only the steps both hold.

A dump of one step names its tensors plainly (`loss`), one of several by step (`step1/loss`). Where
the two dumps hold other steps, the steps only one of them holds are set aside (said in that side's
description), and a one-step side's names take its step, so that step 2 of `steps=[1, 2]` meets
step 2 of `steps=[2]`. Two dumps without a step in common are not compared: step 1 against step 2
would read one step's drift as a divergence.
"""

from __future__ import annotations

from dataclasses import replace

from megalign.compare.entries import Source
from megalign.errors import UserError


def share_steps(a: Source, b: Source) -> tuple[Source, Source]:
    """The two sources, each holding only the steps of the other's where the formats record steps."""
    if not a.steps or not b.steps or set(a.steps) == set(b.steps):
        return a, b
    shared = set(a.steps) & set(b.steps)
    if not shared:
        raise UserError(f"A holds {_steps(a.steps)} and B {_steps(b.steps)}: no step in common, nothing compared")
    return _keep(a, shared, "B"), _keep(b, shared, "A")


def _keep(source: Source, shared: set[int], other: str) -> Source:
    """`source` with its entries of the `shared` steps (and those outside any step), named by step."""
    several = len(source.steps) > 1

    def named(entry):
        if several or entry.step is None:
            return entry
        return replace(entry, name=f"step{entry.step}/{entry.name}", order=(entry.step, *entry.order))

    aside = sorted(set(source.steps) - shared)
    entries = [named(e) for e in source.entries if e.step is None or e.step in shared]
    note = f", {_steps(aside)} set aside (not in {other})" if aside else ""
    return replace(source, entries=entries, description=source.description + note)


def _steps(steps) -> str:
    steps = sorted(steps)
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
