"""Which tensor of A is compared with which of B.

Entries are matched by (kind, name); a plain tensor file has no kinds, so its tensors match the
first tensor of the same name on the other side (in execution order: a forward activation before
the gradient of the same name). Pairs come in the execution order of A (B's order for tensors only
in B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalign.compare.entries import Entry, Source


@dataclass
class Pair:
    kind: str
    name: str
    a: Optional[Entry]  # None: only in B
    b: Optional[Entry]

    @property
    def layer(self) -> Optional[int]:
        return self.a.layer if self.a else self.b.layer


def match_entries(a: Source, b: Source) -> list[Pair]:
    kindless = any(e.kind is None for e in a.entries + b.entries)
    key = (lambda e: e.name) if kindless else (lambda e: (e.kind, e.name))
    in_b: dict = {}
    for entry in sorted(b.entries, key=lambda e: e.order):
        in_b.setdefault(key(entry), entry)  # kindless: the first of a name in execution order
    pairs, matched = [], set()
    for entry in sorted(a.entries, key=lambda e: e.order):
        other = in_b.get(key(entry))
        if other is not None and id(other) in matched:
            other = None
        if other is not None:
            matched.add(id(other))
        pairs.append((entry.order, _pair(entry, other)))
    pairs += [(e.order, _pair(None, e)) for e in b.entries if id(e) not in matched]
    pairs.sort(key=lambda p: p[0])  # stable: B-only tensors fall in place by B's own order
    return [p for _, p in pairs]


def _pair(a: Optional[Entry], b: Optional[Entry]) -> Pair:
    kind = (a.kind if a else None) or (b.kind if b else None) or "tensor"
    return Pair(kind=kind, name=(a or b).name, a=a, b=b)
