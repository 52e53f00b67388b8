"""Byte sizes as people write and read them: what a run printed it wrote, a zoom's budget."""

from __future__ import annotations

import math
import re

from megalign.errors import UserError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def parse_bytes(text: str, where: str) -> int:
    """"2GiB", "500MB", "1e9" (bytes) as a count of bytes; UserError (naming `where`) for anything else."""
    size = _SIZE.fullmatch(text)
    try:
        value = float(size.group(1)) * _UNITS[size.group(2).lower()] if size else math.nan
    except (KeyError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise UserError(f"{where}: expected a size such as 2GiB, 500MiB or 1e9 (bytes), got {text!r}")
    return int(value)
