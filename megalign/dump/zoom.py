"""Which records a dump holds in full, the rest as --stats-only statistics: a zoom into one step.

    "STEP:REGEX"   full values for the tensors of step STEP whose name REGEX finds (re.search)
    "REGEX"        the same in every step (megalign's own runs have no steps)

Dumper(dump_only=), MEGALIGN_DUMP_ONLY and `megalign forward|backward --dump-only` all read it here.
A zoomed dump holds every tensor a stats-only one does: compare sees nothing missing, and compares
values where both sides hold them, statistics elsewhere. STEP is the step a record is written under
(a Dumper's `step(n)` block, and its gradients read as the optimizer steps after the block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megalign.errors import UserError

_STEP = re.compile(r"(\d+):(.*)", re.DOTALL)


@dataclass(frozen=True)
class FullValues:
    step: Optional[int]  # None: every step
    pattern: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.pattern))

    def wants(self, step: Optional[int], name: str) -> bool:
        return (self.step is None or self.step == step) and bool(self._compiled.search(name))

    def __str__(self) -> str:
        """As MEGALIGN_DUMP_ONLY says it."""
        return self.pattern if self.step is None else f"{self.step}:{self.pattern}"


def full_values(text: "str | FullValues", where: str = "dump_only") -> FullValues:
    """`text` ("STEP:REGEX" or "REGEX") as a FullValues; UserError (naming `where`) for anything else."""
    if isinstance(text, FullValues):
        return text
    if not isinstance(text, str) or not text:
        raise UserError(f"{where}: expected STEP:REGEX or REGEX, got {text!r}")
    stepped = _STEP.fullmatch(text)
    step, pattern = (int(stepped.group(1)), stepped.group(2)) if stepped else (None, text)
    try:
        return FullValues(step, pattern)
    except re.error as e:
        raise UserError(f"{where}: {pattern!r} is not a valid regular expression: {e}") from None
