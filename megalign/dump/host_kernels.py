"""The CPU statistics' compiled passes (stats._host_stats), in float64 whatever the input's dtype.

A module of their own so that numba is imported only where a CPU tensor's statistics are taken
(0.2 s of import, which a Dumper on a GPU or one turned off would pay otherwise). `fast_sums` lets
LLVM reorder and vectorize the sums (still float64) and sees no NaN or Inf apart; `careful_stats`
skips them, counting each, for the rare chunk whose fast sums came out non-finite. `sums_and_sketch` is fast_sums with the
chunk's sketch (sketch.py) taken in the same pass.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from megalign.dump.sketch import K, M1, M2, SEED

_JIT = dict(nogil=True, cache=True, error_model="numpy")
_SEED, _M1, _M2, _LOW = np.uint64(SEED), np.uint64(M1), np.uint64(M2), np.uint64(K - 1)


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


@numba.njit(inline="always", **_JIT)
def _mix(g):  # pragma: no cover - compiled
    x = np.uint64(g) + _SEED
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@numba.njit(fastmath={"reassoc"}, **_JIT)
def sums_and_sketch(x, start, base, cols, sketch):  # pragma: no cover - compiled
    """fast_sums of x, the elements of a shard from flat `start` on, and their finite values added
    into `sketch`: element (r, c) of the shard is at base[r] + cols[c] in the whole."""
    total = sum_sq = abs_sum = 0.0
    r = start // cols.size
    c = start - r * cols.size
    row = base[r] if r < base.size else 0
    for i in range(x.size):
        a = np.float64(x[i])
        total += a
        sum_sq += a * a
        abs_sum += abs(a)
        if math.isfinite(a):
            h = _mix(row + cols[c])
            sketch[h & _LOW] += -a if h >> np.uint64(63) else a
        c += 1
        if c == cols.size:
            c = 0
            r += 1
            row = base[r] if r < base.size else 0
    return total, sum_sq, abs_sum
