"""How a run's parameter gradients were reduced over its data-parallel ranks, as dump.json records it.

torch's DDP and FSDP2 average by default: the reduced gradient is the ranks' sum divided by their
number, so the loss that trains on the whole batch is each rank's share times the world size, and
every activation gradient of such a run is that many times the one-process one. compare divides the
activation gradients by the recorded divisor before judging (compare/objective.py), so that the
standard idioms pass as written and a loss that does not match its reduction fails where it starts.
The Dumper reads it from the modules that reduce, or the user states it (capture/reducers.py).

dump.json's `grad_reduction`: {"divide_by": a number or null (unknown), "by": what said so,
"per_step": {step: its divisor} where it changes by step}; dumps without it (older ones, megalign's
own runs) are read as summed (divide_by 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megalign.dump.validate import Malformed
from megalign.errors import is_number

META_KEY = "grad_reduction"


@dataclass(frozen=True)
class GradReduction:
    """The divisor of the ranks' summed gradients (None: unknown), and what said so."""

    divide_by: Optional[float]
    by: str
    per_step: tuple[tuple[int, float], ...] = ()  # (step, divisor) where a step's differs (a token count)

    def to_dict(self) -> dict:
        steps = {"per_step": {str(step): divisor for step, divisor in self.per_step}} if self.per_step else {}
        return {"divide_by": self.divide_by, "by": self.by, **steps}

    def divisor(self, step: Optional[int]) -> Optional[float]:
        return dict(self.per_step).get(step, self.divide_by)

    def describe(self) -> str:
        """For compare's header."""
        if self.per_step:
            return f"grads /tokens a step ({self.by}): act grads /" + ", /".join(f"{d:g}" for _, d in self.per_step)
        if self.divide_by is None:
            return f"grads reduced as not recorded ({self.by}): act grads as dumped"
        if self.divide_by == 1:
            return f"grads summed ({self.by})"
        return f"grads /{self.divide_by:g} ({self.by}): act grads /{self.divide_by:g}"

    @classmethod
    def from_meta(cls, meta: dict, where: str) -> Optional["GradReduction"]:
        """dump.json's record; None where it has none."""
        raw = meta.get(META_KEY)
        if raw is None:
            return None
        divide_by = raw.get("divide_by") if isinstance(raw, dict) else 0
        if not isinstance(raw, dict) or not isinstance(raw.get("by"), str) or \
                not (divide_by is None or (is_number(divide_by) and math.isfinite(divide_by) and divide_by > 0)):
            raise Malformed(f"{where}: {META_KEY} must be {{\"divide_by\": a positive number or null, \"by\": text}}, "
                            f"got {raw!r}")
        per_step = raw.get("per_step", {})
        if not isinstance(per_step, dict) or not all(
                step.isdigit() and is_number(d) and math.isfinite(d) and d > 0 for step, d in per_step.items()):
            raise Malformed(f"{where}: {META_KEY}.per_step must map steps to positive numbers, got {per_step!r}")
        return cls(divide_by=None if divide_by is None else float(divide_by), by=raw["by"],
                   per_step=tuple(sorted((int(step), float(d)) for step, d in per_step.items())))


def mean_of(ranks: int) -> str:
    """How `by` says a mean over `ranks` ranks."""
    return "one rank" if ranks == 1 else f"mean of {ranks} ranks"
