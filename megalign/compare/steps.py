"""Lining up dumps of a training loop's steps (a Dumper's `steps=`): only the steps all of them hold.

A dump of one step names its tensors plainly (`loss`), one of several by step (`step1/loss`, by
step_name and ordered by step_order). Where the dumps hold other steps, the steps one of them lacks
are set aside (said in that side's description), and so are the tensors written outside any step,
which stand at other points of the loops; a one-step side's names take its step, so that step 2 of
`steps=[1, 2]` meets step 2 of `steps=[2]`. Dumps without a step in common are not compared: step 1
against step 2 would read one step's drift as a divergence.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megalign.compare.entries import Source
from megalign.errors import UserError


def step_name(step: int, name: str) -> str:
    return f"step{step}/{name}"


def step_order(step: Optional[int]) -> tuple:
    """An entry's order begins with its step where a dump holds several (outside any step: first)."""
    return (-1 if step is None else step,)


def share_steps(*sources: Optional[Source]) -> list[Optional[Source]]:
    """The sources (A, B, and a reference or None), each holding only the steps all of them hold,
    where their formats record steps."""
    stepped = [s for s in sources if s is not None and s.steps]
    if len({frozenset(s.steps) for s in stepped}) < 2:
        return list(sources)
    labels = {id(s): label for s, label in zip(sources, "ABR") if s is not None}
    shared = set.intersection(*(set(s.steps) for s in stepped))
    if not shared:
        held = [f"{labels[id(s)]} {_listing(s.steps)}" for s in stepped]
        raise UserError(f"{held[0].replace(' ', ' holds ', 1)}, {', '.join(held[1:])}: no step in common, "
                        "nothing compared")
    lacking = {step: [labels[id(s)] for s in stepped if step not in s.steps] for s in stepped for step in s.steps}
    return [s if s is None or not s.steps else _keep(s, shared, lacking) for s in sources]


def _keep(source: Source, shared: set[int], lacking: dict[int, list[str]]) -> Source:
    """`source` with its entries of the `shared` steps only, named by step."""
    several = len(source.steps) > 1

    def named(entry):
        if several:
            return entry
        return replace(entry, name=step_name(entry.step, entry.name), order=step_order(entry.step) + entry.order)

    entries = [named(e) for e in source.entries if e.step in shared]
    notes = [f"{_listing([step])} set aside (not in {' or '.join(lacking[step])})"
             for step in sorted(set(source.steps) - shared)]
    outside = sum(e.step is None for e in source.entries)
    notes += [f"{outside} tensors outside any step set aside"] if outside else []
    return replace(source, entries=entries, description=", ".join([source.description, *notes]))


def _listing(steps) -> str:
    steps = sorted(steps)
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
