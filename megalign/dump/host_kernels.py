"""The CPU statistics' compiled passes (stats._host_stats), in float64 whatever the input's dtype.

A module of their own so that numba is imported only where a CPU tensor's statistics are taken
(0.2 s of import, which a Dumper on a GPU or one turned off would pay otherwise). `fast_sums` lets
LLVM reorder and vectorize the sums (still float64) and sees no NaN or Inf apart; `careful_stats`
skips them, counting each, for the rare chunk whose fast sums came out non-finite.
"""

from __future__ import annotations

import math

import numba
import numpy as np

_JIT = dict(nogil=True, cache=True, error_model="numpy")


@numba.njit(fastmath={"reassoc"}, **_JIT)
def fast_sums(x):  # pragma: no cover - compiled
    total = sum_sq = abs_sum = 0.0
    for i in range(x.size):
        a = np.float64(x[i])
        total += a
        sum_sq += a * a
        abs_sum += abs(a)
    return total, sum_sq, abs_sum


@numba.njit(**_JIT)
def careful_stats(x):  # pragma: no cover - compiled
    total = sum_sq = abs_sum = 0.0
    low, high = np.inf, -np.inf
    nan = inf = 0
    for i in range(x.size):
        a = np.float64(x[i])
        if math.isnan(a):
            nan += 1
        elif math.isinf(a):
            inf += 1
        else:
            total += a
            sum_sq += a * a
            abs_sum += abs(a)
            low = min(low, a)
            high = max(high, a)
    return total, sum_sq, abs_sum, low, high, nan, inf
