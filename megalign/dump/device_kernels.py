"""The device statistics' Triton kernel (stats.SummaryBatch, once `fused`): a tensor's rows of `row`
elements reduced where the tensor lies, in its own dtype, one program a row, into rows of a [rows, 7]
float32 table. The width is stats.ROW, passed in by stats (the rule is stats', and this module, which
stats loads, imports nothing of megalign). Staged first into a float32 buffer instead, each tensor
was read, written and read again (three passes over every activation) and cost the step's thread
three launches (a slice, a copy, a fill) where this costs one.

A module of its own so that Triton is imported only where a device's statistics are taken (it ships
with torch's CUDA builds; where it is absent, importing this module raises ImportError and the
caller stages the rows).
Hand-written rather than torch.compile'd: a compiled function called a tensor at a time cost 0.1 to
0.5 ms of the step's thread a call (its guards), and cannot write into a table at an offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine(sum_a, sq_a, abs_a, low_a, high_a, nan_a, finite_a,
             sum_b, sq_b, abs_b, low_b, high_b, nan_b, finite_b):  # pragma: no cover - runs on a device
    return (sum_a + sum_b, sq_a + sq_b, abs_a + abs_b, tl.minimum(low_a, low_b), tl.maximum(high_a, high_b),
            nan_a + nan_b, finite_a + finite_b)


# The seven reductions in one (tl.reduce of a tuple): 2.66 TB/s on an H100's float32, 93% of torch's
# sum, and 1.25 on bfloat16; seven tl.sum and tl.min apart, 2.07 and 0.85 (one H100 call, docs/gpu.md).
# Not specialised on the sizes (Triton would compile anew for each of 1, multiples of 16 and the rest).
@triton.jit(do_not_specialize=["numel", "first"])
def _row_stats(x, numel, table, first, ROW: tl.constexpr):  # pragma: no cover - runs on a device
    row = tl.program_id(0).to(tl.int64)
    at = row * ROW + tl.arange(0, ROW)
    inside = at < numel
    value = tl.load(x + at, mask=inside, other=0.0).to(tl.float32)
    finite = inside & (value == value) & (tl.abs(value) != float("inf"))
    kept = tl.where(finite, value, 0.0)
    total, sum_sq, abs_sum, low, high, nan, count = tl.reduce(
        (kept, kept * kept, tl.abs(kept), tl.where(finite, value, float("inf")), tl.where(finite, value, -float("inf")),
         (inside & (value != value)).to(tl.float32), finite.to(tl.float32)), 0, _combine)
    padding = tl.maximum((row + 1) * ROW - numel, 0).to(tl.float32)
    out = table + (first + row) * 7
    tl.store(out, total)
    tl.store(out + 1, sum_sq)
    tl.store(out + 2, abs_sum)
    tl.store(out + 3, low)
    tl.store(out + 4, high)
    tl.store(out + 5, nan + padding)
    tl.store(out + 6, count)


def reduce_rows(x: torch.Tensor, table: torch.Tensor, first: int, row: int) -> None:
    """The rows of `row` elements of flat `x` (ceil(numel / row) of them) reduced into table[first:], each row: the
    sum, sum of squares and sum of absolute values of its finite values, their min and max (+inf and
    -inf where none), its NaN count, the elements past x's end counted as NaN as the staged rows'
    padding is, and its finite count."""
    rows = -(-x.numel() // row)
    if rows:
        _row_stats[(rows,)](x, x.numel(), table, first, ROW=row, num_warps=8)
