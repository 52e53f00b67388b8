"""Which training steps a Dumper writes: `steps=` of megalign.Dumper, and MEGALIGN_DUMP_STEPS.

    "all" (the default)      every step, and whatever is added outside a step block; None says it too
    [1, 2] or "1,2"          those steps only
    5 or "5"                 step 5 only
    "every:K"                steps 0, K, 2K, ...

Chosen steps are whole numbers from 0, as a loop counts them: -1 would choose no step, not the last.

With a choice other than "all", nothing is written outside a chosen step's `with dumper.step(n):`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

from megalign.errors import UserError, is_int

Steps = Union[str, int, Iterable[int], "StepChoice", None]


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
    if steps is None:
        return StepChoice()
    if _step(steps):
        steps = [steps]
    if not isinstance(steps, str):
        try:
            listed = list(steps)
        except TypeError:
            raise UserError(f"{where}: expected all, a step, a list of steps, or every:K, got {steps!r}") from None
        if not all(map(_step, listed)):
            raise UserError(f"{where}: steps are whole numbers from 0, got {listed!r}")
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


def _step(n: object) -> bool:
    """An int >= 0 (a bool is no step)."""
    return is_int(n) and n >= 0


def _whole(text: str) -> bool:
    """Digits 0-9 only ("²" is a digit to str.isdigit, and int() refuses it)."""
    return text.isascii() and text.isdigit()
