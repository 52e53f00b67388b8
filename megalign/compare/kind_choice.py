"""--kind and --skip-kind: the kinds of tensors a comparison keeps, named from dump.format's one list.

`--kind param_grad,loss` keeps those kinds only; `--skip-kind activation_grad` leaves those out;
given both, the kinds of --kind less those of --skip-kind. A name outside the list is bad input,
refused before anything is read. Plain tensor files record no kinds: their tensors are of none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalign.dump.format import KINDS
from megalign.errors import UserError


@dataclass(frozen=True)
class KindChoice:
    keep: Optional[str] = None  # --kind, as typed: KIND[,KIND...]
    skip: Optional[str] = None  # --skip-kind

    def __post_init__(self) -> None:
        for option, text in (("--kind", self.keep), ("--skip-kind", self.skip)):
            _kinds(option, text)

    def admits(self, kind: str) -> bool:
        return (not self.keep or kind in _kinds("--kind", self.keep)) and kind not in _kinds("--skip-kind", self.skip)

    def given(self) -> list[str]:
        """The options as typed, for a message that they left nothing to compare."""
        return [f"{option} {text!r}" for option, text in (("--kind", self.keep), ("--skip-kind", self.skip)) if text]


def _kinds(option: str, text: Optional[str]) -> frozenset[str]:
    names = [name.strip() for name in (text or "").split(",")]
    if text is not None and not any(names):
        raise UserError(f"{option} {text!r} names no kind; kinds: {', '.join(KINDS)}")
    unknown = [name for name in names if name and name not in KINDS]
    if unknown:
        raise UserError(f"{option} {text!r}: unknown kind {unknown[0]!r}; kinds: {', '.join(KINDS)}")
    return frozenset(name for name in names if name)
