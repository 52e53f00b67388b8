"""The tensors around a comparison's first divergence, as a zoom dumps them in full (dump/zoom.py):
what `megalign check --zoom` runs again, and the MEGALIGN_DUMP_ONLY compare proposes after a
stats-only comparison diverged.

Around it, in computation order within its step: the BEFORE records before it and the AFTER after
it, each name's activation gradient too (it bears the activation's name), and where the first is a
module's output, the gradients of its parameters and of its direct submodules' (where it is a
parameter's, its module's output and those). The
rule names them exactly: a zoom's cost is known before it runs.

That cost is bounded too. The stats-only pass knows every record's shape and dtype: the first
divergence is always zoomed, and the other names in turn, nearest it first, while their full values
fit a budget a run (BUDGET); a name past it stays stats-only, and the zoom says so by name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from megalign.compare.lineup import UNLINED_STATS
from megalign.compare.metrics import StatsMetrics
from megalign.compare.records import NOT_REASSEMBLABLE, Report, Row
from megalign.compare.steps import step_name
from megalign.dump.format import REPEAT, Kind
from megalign.dump.tensorfile import STORED_DTYPES
from megalign.dump.zoom import FullValues
from megalign.sizes import human_bytes

BEFORE = AFTER = 3
# Full values a zoom may write a run, its ranks together. The bar is 10 GB for a whole check:
# three runs (with --reference) at 2 GiB leave room for the stats-only pass. At Llama-3-8B's shape and
# 2x4096 tokens in fp32 it holds every layer-wide tensor (the residual stream 128 MiB, linear_fc1's
# output 896 MiB) and not attention probabilities (2x32x4096x4096: 4 GiB each), which were 26 GiB of
# the first 8B zoom's 27; and at the 1 GB/s measured on the H200 host's disk it is seconds to write.
BUDGET = 2 << 30
_PARAMETERS = (Kind.PARAM, Kind.PARAM_GRAD)


@dataclass(frozen=True)
class LeftOut:
    """A name of the window whose full values would have taken the zoom past its budget."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class Zoom:
    step: Optional[int]  # None: the dumps record no steps (megalign's own runs)
    names: tuple[str, ...]  # zoomed, as the runs record them, in computation order
    nbytes: int  # their full values, in the widest run
    budget: int
    left_out: tuple[LeftOut, ...] = ()  # the window's names kept stats-only by the budget, nearest first

    @property
    def rule(self) -> FullValues:
        return FullValues(self.step, "^(?:" + "|".join(map(re.escape, self.names)) + ")$")

    def line(self) -> str:
        """What was zoomed, under the zoomed comparison."""
        where = "" if self.step is None else f"step {self.step}, "
        return (f"zoomed: {where}tensors {self.names[0]}..{self.names[-1]} ({len(self.names)} names), full values "
                f"({human_bytes(self.nbytes)} a run); the rest stats-only" + self.past_budget())

    def past_budget(self) -> str:
        """The window's names its budget left stats-only, each with its size: "; past ..." or ""."""
        if not self.left_out:
            return ""
        return (f"; past the zoom's {human_bytes(self.budget)} budget, stats-only: "
                + ", ".join(f"{left.name} ({human_bytes(left.nbytes)})" for left in self.left_out))


def stats_divergence(report: Report) -> Optional[Row]:
    """The first divergence, where it was judged on statistics only: what a zoom would see in full."""
    if report.first_divergence is None:
        return None
    row = report.rows[report.first_divergence]
    return row if isinstance(row.metrics, StatsMetrics) else None


def unlined(rows: list[Row]) -> int:
    """How many token tensors a stats-only comparison left unjudged, its runs' rows laid out differently
    (packed against padded, or padded to other lengths: lineup.py needs values). A zoom cannot judge
    them either: outside it they are statistics again."""
    return sum(row.status == NOT_REASSEMBLABLE and any(note.endswith(UNLINED_STATS) for note in row.notes)
               for row in rows)


def zoom_around(report: Report, budget: int = BUDGET, itemsize: int = 0) -> Optional[Zoom]:
    """The tensors around the first divergence, within `budget` bytes a run but for the first itself,
    each element costing at least `itemsize` bytes (an fp64 reference run's 8); None where nothing
    diverged."""
    if report.first_divergence is None:
        return None
    steps = {(entry.kind, entry.name): entry.step for source in (report.b, report.a) for entry in source.entries}
    step = steps.get((report.rows[report.first_divergence].kind, report.rows[report.first_divergence].name))
    # The rows of its step, in computation order: a window counts its own step's records only.
    rows = [row for row in report.rows if steps.get((row.kind, row.name)) == step]
    at = next(i for i, row in enumerate(rows) if row.index == report.first_divergence)
    first = rows[at]
    module = _recorded(first.name, step)
    if first.kind in _PARAMETERS:
        module = module.rpartition(".")[0]
    chosen = rows[max(0, at - BEFORE):at + AFTER + 1] + \
        [row for row in rows if row.kind in _PARAMETERS and _owned(module, _recorded(row.name, step))] + \
        [row for row in rows if _recorded(row.name, step) == module]
    names = {_recorded(row.name, step) for row in chosen}
    ordered = list(dict.fromkeys(name for name in (_recorded(row.name, step) for row in rows) if name in names))
    # What each name's records cost, and how near its nearest lies to the first divergence (an
    # activation's gradient may lie nearer than the activation).
    cost, distance = dict.fromkeys(ordered, 0), dict.fromkeys(ordered, len(rows))
    for i, row in enumerate(rows):
        if (name := _recorded(row.name, step)) in cost:
            cost[name] += _nbytes(row, itemsize)
            distance[name] = min(distance[name], abs(i - at))
    own = _recorded(first.name, step)
    kept, left_out, spent = {own}, [], cost[own]
    for name in sorted(ordered, key=distance.__getitem__):
        if name == own:
            continue
        if spent + cost[name] <= budget:
            kept.add(name)
            spent += cost[name]
        else:
            left_out.append(LeftOut(name, cost[name]))
    return Zoom(step, tuple(name for name in ordered if name in kept), spent, budget, tuple(left_out))


def _nbytes(row: Row, itemsize: int) -> int:
    """A row's full values in the widest of its runs."""
    shape = row.shape_a if row.shape_a is not None else row.shape_b
    widths = [STORED_DTYPES[dtype].itemsize for dtype in (row.dtype_a, row.dtype_b) if dtype in STORED_DTYPES]
    return math.prod(shape or ()) * max([itemsize, *widths]) if shape is not None else 0


def _owned(module: str, parameter: str) -> bool:
    """A parameter of `module` or of one of its direct submodules: a layer's, not a whole model's (the
    first divergence at `decoder` would zoom every layer's gradients)."""
    return parameter.startswith(module + ".") and parameter[len(module) + 1:].count(".") <= 1


def _recorded(label: str, step: Optional[int]) -> str:
    """A row's name as the run recorded it: without its step (step1/...) and its call's repeat (@1)."""
    prefix = step_name(step, "") if step is not None else ""
    return REPEAT.sub("", label.removeprefix(prefix))
