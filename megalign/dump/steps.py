"""Which training steps a Dumper writes: `steps=` of megalign.Dumper, and MEGALIGN_DUMP_STEPS.

    "all" (the default)      every step, and whatever is added outside a step block
    [1, 2] or "1,2"          those steps only
    "every:K"                steps 0, K, 2K, ...

With a choice other than "all", nothing is written outside a chosen step's `with dumper.step(n):`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

from megalign.errors import UserError

Steps = Union[str, Iterable[int], "StepChoice"]


@dataclass(frozen=True)
class StepChoice:
    listed: Optional[frozenset[int]] = None  # None: not a list
    every: Optional[int] = None  # None: not "every:K"

    @property
    def all(self) -> bool:
        return self.listed is None and self.every is None

    def __str__(self) -> str:
        """As MEGALIGN_DUMP_STEPS would say it."""
        if self.listed is not None:
            return ",".join(map(str, sorted(self.listed)))
        return "all" if self.every is None else f"every:{self.every}"

    def wants(self, n: int) -> bool:
        if self.listed is not None:
            return n in self.listed
        return self.every is None or n % self.every == 0


def choose_steps(steps: Steps, where: str = "steps") -> StepChoice:
    """`steps` as a StepChoice; UserError (naming `where`) for anything else."""
    if isinstance(steps, StepChoice):
        return steps
    if not isinstance(steps, str):
        listed = list(steps)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in listed):
            raise UserError(f"{where}: steps are ints, got {listed!r}")
        return StepChoice(listed=frozenset(listed))
    text = steps.strip()
    if text == "all":
        return StepChoice()
    if text.startswith("every:"):
        k = text.removeprefix("every:")
        if not _whole(k) or int(k) < 1:
            raise UserError(f"{where}: every:K needs a whole number K >= 1, got {steps!r}")
        return StepChoice(every=int(k))
    parts = [part.strip() for part in text.split(",")]
    if not all(map(_whole, parts)):
        raise UserError(f"{where}: expected all, a list like 1,2, or every:K, got {steps!r}")
    return StepChoice(listed=frozenset(int(part) for part in parts))


def _whole(text: str) -> bool:
    """Digits 0-9 only ("²" is a digit to str.isdigit, and int() refuses it)."""
    return text.isascii() and text.isdigit()
