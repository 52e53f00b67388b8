"""One pass over two arrays computing every sum a comparison needs, compiled with numba.

Written as loops for numba, not as torch operations, because torch needs one pass per reduction
(the float64 copies, three dot products, a 1-norm, a max, an argmax: measured 1.7x slower than one
fused pass on 64M float32 pairs, on top of the float64 buffers it fills). Elements are widened to
float64 before any arithmetic, so products of float32 values are exact and every sum accumulates in
float64. `reassoc` lets LLVM vectorize the sums (a different summation order, still float64);
no other fast-math flag is set, so NaN and Inf propagate and are seen.

`_fast` assumes finite values of a moderate size and is several times faster than `_careful`,
which counts NaN/Inf, sums over positions finite on both sides, and scales: its squares are summed
times 2^(-2 exp), 2^exp being the largest finite |value| rounded up to a power of two (LAPACK
dnrm2's idea; a power of two scales exactly). Unscaled, 1e-170 squared underflows to 0 (a sign
flip at 1e-170 was no difference at all) and 1e200 squared overflows. `sums` runs the careful pass
only when the fast one's sums come out non-finite or below SMALLEST, where squares may underflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

BLOCK = 4096  # elements whose maximum is taken before the running one: the argmax is looked up once
# Fast sums of squares at least this large have their largest terms, and any difference down to
# 1e-120 of them, in float64's normal range: no underflow to rescale for.
SMALLEST = 2.0 ** -600
MIN_EXP = -1021  # the smallest scale exponent: 2^1021 is finite
NO_EXP = -(1 << 20)  # the scale exponent of sums over zeros only: any other range's scale wins


@dataclass
class Sums:
    """Sums over one range of positions; `add` merges ranges in order."""

    xx: float = 0.0  # sum of x^2 * 2^(-2 exp)
    yy: float = 0.0
    dd: float = 0.0  # sum of (x - y)^2 * 2^(-2 exp)
    abs_diff: float = 0.0  # sum of |x - y|
    max_abs: float = -1.0  # -1: no finite pair yet
    max_index: int = -1  # first position holding max_abs
    finite_pairs: int = 0
    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0
    nonfinite_diff: int = 0  # positions where NaN/Inf differ: one side only, or +Inf against -Inf
    sx: float = 0.0  # sum of x, and of y: the scale check compares them (scale.py)
    sy: float = 0.0
    exp: int = NO_EXP  # the squares' scale (the module's docstring): 0 unscaled, NO_EXP none yet

    @property
    def finite(self) -> bool:
        return math.isfinite(self.xx) and math.isfinite(self.yy)

    def add(self, other: "Sums", offset: int) -> None:
        """Merge the sums of the next range, which starts at position `offset`."""
        for name in ("abs_diff", "finite_pairs", "nan_a", "nan_b", "inf_a", "inf_b", "nonfinite_diff", "sx", "sy"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        # At the larger of the two scales: what underflows in the other range is negligible beside it.
        exp = max(self.exp, other.exp)
        mine, theirs = 2 * (self.exp - exp), 2 * (other.exp - exp)
        for name in ("xx", "yy", "dd"):
            setattr(self, name, math.ldexp(getattr(self, name), mine) + math.ldexp(getattr(other, name), theirs))
        self.exp = exp
        if other.max_abs > self.max_abs:  # strictly: the first position of the maximum is kept
            self.max_abs, self.max_index = other.max_abs, offset + other.max_index


_JIT = dict(nogil=True, cache=True, error_model="numpy")


@numba.njit(fastmath={"reassoc"}, **_JIT)
def _fast(x, y):  # pragma: no cover - compiled
    n = x.size
    xx = yy = dd = abs_diff = sx = sy = 0.0
    best, best_block = -1.0, -1
    for start in range(0, n, BLOCK):
        bxx = byy = bdd = babs = bmax = bsx = bsy = 0.0
        for i in range(start, min(start + BLOCK, n)):
            a, b = np.float64(x[i]), np.float64(y[i])
            d = a - b
            bxx += a * a
            byy += b * b
            bdd += d * d
            e = abs(d)
            babs += e
            bmax = max(bmax, e)
            bsx += a
            bsy += b
        xx += bxx
        yy += byy
        dd += bdd
        abs_diff += babs
        sx += bsx
        sy += bsy
        if bmax > best:
            best, best_block = bmax, start
    index = -1
    if best_block >= 0:
        for i in range(best_block, min(best_block + BLOCK, n)):
            if abs(np.float64(x[i]) - np.float64(y[i])) == best:
                index = i
                break
    return xx, yy, dd, abs_diff, best, index, sx, sy


@numba.njit(**_JIT)
def _careful(x, y):  # pragma: no cover - compiled
    top = 0.0  # the scale first: one more pass, on the rare arrays that come here
    for i in range(x.size):
        a, b = np.float64(x[i]), np.float64(y[i])
        if math.isfinite(a) and math.isfinite(b):
            top = max(top, abs(a), abs(b))
    # At least MIN_EXP: 2^-exp of a subnormal maximum (exp down to -1073) would overflow to inf, and
    # inf * 0 make the sums NaN; scaled by 2^1021, subnormals square far above underflow.
    exp = max(math.frexp(top)[1], MIN_EXP) if top > 0.0 else NO_EXP
    inv = math.ldexp(1.0, -exp) if top > 0.0 else 1.0
    xx = yy = dd = abs_diff = sx = sy = 0.0
    best, index = -1.0, -1
    finite = nan_a = nan_b = inf_a = inf_b = nonfinite_diff = 0
    for i in range(x.size):
        a, b = np.float64(x[i]), np.float64(y[i])
        if math.isfinite(a) and math.isfinite(b):
            finite += 1
            d = a - b
            xx += (a * inv) ** 2
            yy += (b * inv) ** 2
            dd += (d * inv) ** 2
            e = abs(d)
            abs_diff += e
            sx += a
            sy += b
            if e > best:
                best, index = e, i
            continue
        na, nb, ia, ib = math.isnan(a), math.isnan(b), math.isinf(a), math.isinf(b)
        nan_a += na
        nan_b += nb
        inf_a += ia
        inf_b += ib
        nonfinite_diff += (na != nb) or (ia != ib) or (ia and ib and a != b)
    return xx, yy, dd, abs_diff, best, index, finite, nan_a, nan_b, inf_a, inf_b, nonfinite_diff, sx, sy, exp


def sums(x: np.ndarray, y: np.ndarray) -> Sums:
    """x, y: flat float32 or float64 arrays of one length."""
    xx, yy, dd, abs_diff, best, index, sx, sy = _fast(x, y)
    fast = Sums(xx, yy, dd, abs_diff, best, index, finite_pairs=x.size, sx=sx, sy=sy, exp=0)
    if fast.finite and xx + yy >= SMALLEST:
        return fast
    return Sums(*_careful(x, y))


def load_kernels() -> None:
    """Compile the kernels for float32 and float64 pairs, or load them from numba's on-disk cache:
    a one-time cost per process, which the first comparison pays otherwise."""
    for dtype in (np.float32, np.float64):
        pair = np.zeros(1, dtype), np.zeros(1, dtype)
        _fast(*pair)
        _careful(*pair)
