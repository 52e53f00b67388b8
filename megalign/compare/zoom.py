"""The tensors around a comparison's first divergence, as a zoom dumps them in full (dump/zoom.py):
what `megalign check --zoom` runs again, and the MEGALIGN_DUMP_ONLY compare proposes after a
stats-only comparison diverged.

Around it, in computation order within its step: the BEFORE records before it and the AFTER after
it, each name's activation gradient too (it bears the activation's name), and where the first is a
module's output, the gradients of its parameters and of its direct submodules' (where it is a
parameter's, its module's output and those). The
rule names them exactly: a zoom's cost is known before it runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megalign.compare.lineup import UNLINED_STATS
from megalign.compare.metrics import StatsMetrics
from megalign.compare.records import NOT_REASSEMBLABLE, Report, Row
from megalign.compare.steps import step_name
from megalign.dump.format import REPEAT, Kind
from megalign.dump.zoom import FullValues

BEFORE = AFTER = 3
_PARAMETERS = (Kind.PARAM, Kind.PARAM_GRAD)


@dataclass(frozen=True)
class Zoom:
    step: Optional[int]  # None: the dumps record no steps (megalign's own runs)
    names: tuple[str, ...]  # as the runs record them, in computation order

    @property
    def rule(self) -> FullValues:
        return FullValues(self.step, "^(?:" + "|".join(map(re.escape, self.names)) + ")$")

    def line(self) -> str:
        """What was zoomed, under the zoomed comparison."""
        where = "" if self.step is None else f"step {self.step}, "
        return (f"zoomed: {where}tensors {self.names[0]}..{self.names[-1]} ({len(self.names)} names), full values; "
                "the rest stats-only")


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


def zoom_around(report: Report) -> Optional[Zoom]:
    """The tensors around the first divergence; None where nothing diverged."""
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
    ordered = dict.fromkeys(name for name in (_recorded(row.name, step) for row in rows) if name in names)
    return Zoom(step, tuple(ordered))


def _owned(module: str, parameter: str) -> bool:
    """A parameter of `module` or of one of its direct submodules: a layer's, not a whole model's (the
    first divergence at `decoder` would zoom every layer's gradients)."""
    return parameter.startswith(module + ".") and parameter[len(module) + 1:].count(".") <= 1


def _recorded(label: str, step: Optional[int]) -> str:
    """A row's name as the run recorded it: without its step (step1/...) and its call's repeat (@1)."""
    prefix = step_name(step, "") if step is not None else ""
    return REPEAT.sub("", label.removeprefix(prefix))
