"""Byte buffers that tensor pairs are read into, reused from one pair to the next, within a budget.

Reused because fresh memory costs a page fault per 4 KiB on first touch: reading a dump into new
tensors took twice as long as reading it into warm memory (measured, bench/bench_compare.py). The
budget bounds what the comparison holds at once, lent or kept: a lease waits until its bytes fit,
so the workers compare small pairs side by side and the largest pair alone.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from megalign.errors import UserError

SMALLEST = 4 << 20  # smaller tensors are left to malloc, which keeps and reuses such blocks itself


class TooLarge(UserError, MemoryError):
    """More bytes at once than the machine has: a one-line error (exit 2) instead of an allocation
    that fails with a traceback, or succeeds on overcommit and is OOM-killed when touched."""


def available_memory() -> Optional[int]:
    """MemAvailable of /proc/meminfo: what can be allocated without pushing others out; None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(nbytes: int, what: str) -> None:
    """TooLarge when `what` needs more than the memory available now."""
    available = available_memory()
    if available is not None and nbytes > available:
        raise TooLarge(f"{what} needs {nbytes / 2**30:.1f} GiB of memory at once, more than the "
                       f"{available / 2**30:.1f} GiB available")


class BufferPool:
    def __init__(self, budget: int):
        self.budget = budget
        self._free: list[torch.Tensor] = []
        self._held = 0  # bytes of every buffer, lent or free
        self._changed = threading.Condition()

    @contextmanager
    def lease(self, *sizes: Optional[int]) -> Iterator[list[Optional[torch.Tensor]]]:
        """One uint8 buffer of at least each size (None for a size that is None or under SMALLEST),
        held together: a pair never waits for its second buffer while holding its first."""
        sizes = [size if size and size >= SMALLEST else None for size in sizes]
        with self._changed:
            buffers = self._changed.wait_for(lambda: self._take(sizes))
        try:
            yield buffers
        finally:
            with self._changed:
                self._free += [b for b in buffers if b is not None]
                self._changed.notify_all()

    def _take(self, sizes) -> Optional[list[Optional[torch.Tensor]]]:
        """The buffers, each the smallest free one that fits or a new one; None while new ones do not
        fit in the budget beside those lent (a pair larger than the budget waits until none is)."""
        free = sorted(self._free, key=len)
        chosen: dict[int, torch.Tensor] = {}
        for size, i in sorted(((size, i) for i, size in enumerate(sizes) if size), reverse=True):
            fit = next((k for k, b in enumerate(free) if size <= len(b) <= 2 * size), None)
            if fit is not None:
                chosen[i] = free.pop(fit)
        needed = sum(size for i, size in enumerate(sizes) if size and i not in chosen)
        if self._held + needed > self.budget:  # drop every free buffer, chosen or not, and allocate anew
            self._held -= sum(len(b) for b in free) + sum(len(b) for b in chosen.values())
            free, chosen, needed = [], {}, sum(size for size in sizes if size)
            if self._held + needed > self.budget and self._held > 0:
                self._free = []
                return None  # the lent buffers come back first (a pair larger than the budget waits for all)
        self._free = free
        self._held += needed
        return [chosen[i] if i in chosen else torch.empty(size, dtype=torch.uint8) if size else None
                for i, size in enumerate(sizes)]
