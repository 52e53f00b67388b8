"""The device statistics' Triton kernel (stats.SummaryBatch, once `fused`): a tensor's rows of `row`
elements reduced where the tensor lies, in its own dtype, one program a row, into rows of a [rows, 7]
float32 table, and, in the same pass, each element's value added into the tensor's CountSketch
(sketch.py), a [K] float64 slot of a sketch table. The width is stats.ROW, passed in by stats (the
rule is stats', and this module, which stats loads, imports nothing of megalign but sketch.py's
constants). Staged first into a float32 buffer instead, each tensor was read, written and read again
(three passes over every activation) and cost the step's thread three launches (a slice, a copy, a
fill) where this costs one; the sketch in eager torch ops was about twenty-five kernels over int64
temporaries a tensor, 4.3x (hidden 4096) to 8.6x (hidden 1024) a stats-only loop (docs/gpu.md).

The sketch's arithmetic budget. At an H100's 3.35 TB/s a bf16 element arrives every 0.6 ps; the
card issues about 3e13 lane instructions a second, so about 18 a bf16 element (35 a float32) keep
the kernel memory-bound. The statistics alone take about 47 (bf16 ran at 1.25 TB/s); splitmix64's
finalizer, two 64-bit multiplies and three 64-bit xor-shifts, about 25 more. What is left cannot
add a value into one of 128 float64 buckets directly:
- a dense one-hot ([elements, 128] compare, select, add) is 384 operations an element: 20x over;
- a float64 atomic add an element goes to L2 (Triton has no shared-memory atomics), one L2
  transaction an element against 32 bytes of bandwidth: about 1e11 elements a second, 16x below
  the bf16 read rate.
- So the buckets are summed by the tensor cores: bucket = 16 * hi + lo (hi: 3 bits, lo: 4), and a
  sub-block of SUB elements gives [hi-one-hot x value] (M) @ [lo-one-hot] (N = 16) = each bucket's
  sum. Exact, as the sketch must be (a float64 sum, equal to the host's up to summation order): the
  values go in as SLICES integer slices of 11 bits each (exact in float16) of the sub-block's fixed
  point, 2^E above its largest magnitude: v = 2^E * sum_k q_k 2^(-11(k+1)) + rest, |rest| <= 2^(E-45).
  A slice's products are exact and its float32 sums stay integers below 2^21 (SUB * 2^11), so exact;
  they are scaled and summed in float64. A float32 element within 2^20 of the sub-block's largest
  is taken exactly (24 significant bits), a bf16 or fp16 one within 2^36; below, its error is under
  2^-45 of the largest (2.8e-14 of it), far below any rounding compare resolves (a 5e-8 relative
  difference of float32 tensors is a 3e-4 difference in the norm's units).
  Per element: 8 compares and 32 selects for the [32, SUB] left operand, 16 for the right, 20 for
  the slices, beside the hash and statistics: about 150 instructions, ALU-bound at about 3x the
  statistics kernel's time alone, expected (bench/bench_sketch.py measures it on the card).
Each program's [K] partial goes into the tensor's slot by 128 float64 atomic adds (one per 4096
elements read: no contention to speak of, and no [rows, K] table to write and reduce again); the
order of those adds is the only difference from the host's sum.

Where the element lies in the whole: element i of the flat shard is (r, c) = divmod(i, width), at
base[r] + cols[c] (sketch.rows_and_cols). A program divides its first index once; an element's
offset from there is at most `width + ROW`, so its row is one more or not (width >= ROW), or comes
from a float32 multiply by 1/width, exact with a margin of 0.5/(width + ROW) >= 6e-5 against a
float32 error of 2.4e-7.

A module of its own so that Triton is imported only where a device's statistics are taken (it ships
with torch's CUDA builds; where it is absent, importing this module raises ImportError and the
caller stages the rows and sketches with torch's ops).
Hand-written rather than torch.compile'd: a compiled function called a tensor at a time cost 0.1 to
0.5 ms of the step's thread a call (its guards), and cannot write into a table at an offset.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megalign.dump.sketch import M1, M2, SEED  # and K = 128 buckets: 8 x 16 here

_SEED, _M1, _M2 = tl.constexpr(SEED), tl.constexpr(M1), tl.constexpr(M2)  # what a kernel may read of a module
SUB = 512  # elements summed by one dot: its operands, [32, SUB] and [SUB, 16] float16, are 48 KiB
SLICES = 4  # 11-bit slices of each value: 44 bits below the sub-block's largest


@triton.jit
def _combine(sum_a, sq_a, abs_a, low_a, high_a, nan_a, finite_a,
             sum_b, sq_b, abs_b, low_b, high_b, nan_b, finite_b):  # pragma: no cover - runs on a device
    return (sum_a + sum_b, sq_a + sq_b, abs_a + abs_b, tl.minimum(low_a, low_b), tl.maximum(high_a, high_b),
            nan_a + nan_b, finite_a + finite_b)


@triton.jit
def _power_of_two(n):  # pragma: no cover - runs on a device
    """2^n as float32, for int32 n in [-126, 127], from its bits."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round(s):  # pragma: no cover - runs on a device
    """s to the nearest integer, for |s| <= 2^22: through float32's ulp of 1 at 1.5 * 2^23."""
    return (s + 12582912.0) - 12582912.0


@triton.jit
def _bucket_sums(kept, h, biggest, SUB: tl.constexpr, SLICES: tl.constexpr):  # pragma: no cover - on a device
    """[8, 16] float64: bucket 16 * hi + lo's signed sum of `kept` (0 where not finite), each element in
    bucket h & 127, negated where h's top bit is set; `biggest`: the largest |kept|."""
    bucket = (h & 127).to(tl.int32)
    hi, lo = bucket >> 4, bucket & 15
    sign = tl.where((h >> 63) != 0, -1.0, 1.0)
    # 2^E above the largest: float32's exponent field, one more (0 gives -126: a subnormal's binade).
    E = ((biggest.to(tl.int32, bitcast=True) >> 23) & 255) - 126
    half = E >> 1
    t = kept * _power_of_two(-half) * _power_of_two(half - E)  # |t| < 1, exact (powers of two)
    s0 = t * 2048.0
    q0 = _round(s0)
    s1 = (s0 - q0) * 2048.0
    q1 = _round(s1)
    s2 = (s1 - q1) * 2048.0
    q2 = _round(s2)
    q3 = _round((s2 - q2) * 2048.0)
    # [SLICES, SUB]: slice k of each element, signed; then [SLICES, 8, SUB] under hi's one-hot.
    slices = tl.reshape(tl.permute(tl.join(tl.join(q0, q1), tl.join(q2, q3)), (2, 1, 0)), (SLICES, SUB)) * sign[None, :]
    rows = tl.arange(0, 8)
    left = tl.where(hi[None, None, :] == rows[None, :, None], slices[:, None, :], 0.0)
    left = tl.reshape(left, (SLICES * 8, SUB)).to(tl.float16)
    right = (lo[:, None] == tl.arange(0, 16)[None, :]).to(tl.float16)
    sums = tl.dot(left, right, out_dtype=tl.float32)  # [SLICES * 8, 16], each an exact integer
    # Slice k's unit: 2^(E - 11 (k + 1)), in float64 (the smallest reaches 2^-170).
    k = tl.arange(0, SLICES * 8) // 8
    unit = ((E.to(tl.int64) - 11 * (k + 1) + 1023) << 52).to(tl.float64, bitcast=True)
    return tl.sum(tl.reshape(sums.to(tl.float64) * unit[:, None], (SLICES, 8, 16)), 0)


@triton.jit
def _located_sums(kept, step, inside, biggest, first_row, first_col, inverse, base, cols, width, SUB: tl.constexpr,
                  SLICES: tl.constexpr, WIDE: tl.constexpr):  # pragma: no cover - runs on a device
    """_bucket_sums of a sub-block's elements, `step` on from its program's first, which is the
    shard's (first_row, first_col); each hashed at its place in the whole."""
    if WIDE:  # width >= ROW: at most one row further on
        col = first_col + step
        down = (col >= width).to(tl.int32)
    else:  # below 2 * ROW: int32, and its row through float32
        col = first_col.to(tl.int32) + step
        down = ((col.to(tl.float32) + 0.5) * inverse).to(tl.int32)
    col -= down * width
    g = tl.load(base + first_row + down, mask=inside, other=0) + tl.load(cols + col, mask=inside, other=0)
    x = g.to(tl.uint64, bitcast=True) + _SEED
    x = (x ^ (x >> 30)) * _M1
    x = (x ^ (x >> 27)) * _M2
    return _bucket_sums(kept, x ^ (x >> 31), biggest, SUB, SLICES)


# The seven reductions in one (tl.reduce of a tuple): 2.66 TB/s on an H100's float32, 93% of torch's
# sum, and 1.25 on bfloat16; seven tl.sum and tl.min apart, 2.07 and 0.85 (one H100 call, docs/gpu.md).
# Not specialised on the sizes (Triton would compile anew for each of 1, multiples of 16 and the rest).
@triton.jit
def _reduce_row(x, numel, start, base, cols, width, ROW: tl.constexpr, SUB: tl.constexpr, SLICES: tl.constexpr,
                WIDE: tl.constexpr, SKETCH: tl.constexpr):  # pragma: no cover - runs on a device
    """A row's seven statistics and its [8, 16] bucket sums (zero without SKETCH), SUB elements at a time."""
    first_row = start // width
    first_col = start - first_row * width
    inverse = 1.0 / width.to(tl.float32)
    total, sum_sq, abs_sum, nan, count = 0.0, 0.0, 0.0, 0.0, 0.0
    low, high = float("inf"), -float("inf")
    buckets = tl.zeros((8, 16), tl.float64)
    for offset in range(0, ROW, SUB):
        step = offset + tl.arange(0, SUB)
        at = start + step
        inside = at < numel
        value = tl.load(x + at, mask=inside, other=0.0).to(tl.float32)
        finite = inside & (value == value) & (tl.abs(value) != float("inf"))
        kept = tl.where(finite, value, 0.0)
        part = tl.reduce(
            (kept, kept * kept, tl.abs(kept), tl.where(finite, value, float("inf")),
             tl.where(finite, value, -float("inf")), (inside & (value != value)).to(tl.float32),
             finite.to(tl.float32)), 0, _combine)
        total, sum_sq, abs_sum, low, high, nan, count = _combine(total, sum_sq, abs_sum, low, high, nan, count, *part)
        if SKETCH:
            biggest = tl.maximum(tl.maximum(-part[3], part[4]), 1e-30)  # none or all zero: any scale sums them
            buckets += _located_sums(kept, step, inside, biggest, first_row, first_col, inverse, base, cols, width,
                                     SUB, SLICES, WIDE)
    return total, sum_sq, abs_sum, low, high, nan, count, buckets


# The seven reductions in one (tl.reduce of a tuple): 2.66 TB/s on an H100's float32, 93% of torch's
# sum, and 1.25 on bfloat16; seven tl.sum and tl.min apart, 2.07 and 0.85 (one H100 call, docs/gpu.md).
# Not specialised on the sizes (Triton would compile anew for each of 1, multiples of 16 and the rest).
@triton.jit(do_not_specialize=["numel", "first", "width", "slot"])
def _row_stats(x, numel, table, first, base, cols, width, sketch, slot, keep, ROW: tl.constexpr, SUB: tl.constexpr,
               SLICES: tl.constexpr, WIDE: tl.constexpr, SKETCH: tl.constexpr,
               KEEP: tl.constexpr):  # pragma: no cover - runs on a device
    row = tl.program_id(0).to(tl.int64)
    padding = tl.maximum((row + 1) * ROW - numel, 0).to(tl.float32)
    go = True
    if KEEP:
        go = tl.load(keep) != 0
    if go:
        total, sum_sq, abs_sum, low, high, nan, count, buckets = _reduce_row(x, numel, row * ROW, base, cols, width,
                                                                             ROW, SUB, SLICES, WIDE, SKETCH)
    else:  # a record thrown away: read as nothing but NaN, and no sketch
        total, sum_sq, abs_sum, low, high, count = 0.0, 0.0, 0.0, float("inf"), -float("inf"), 0.0
        nan = ROW - padding
        buckets = tl.zeros((8, 16), tl.float64)
    out = table + (first + row) * 7
    tl.store(out, total)
    tl.store(out + 1, sum_sq)
    tl.store(out + 2, abs_sum)
    tl.store(out + 3, low)
    tl.store(out + 4, high)
    tl.store(out + 5, nan + padding)
    tl.store(out + 6, count)
    if SKETCH:
        tl.atomic_add(sketch + slot * 128 + tl.arange(0, 8)[:, None] * 16 + tl.arange(0, 16)[None, :], buckets,
                      sem="relaxed")


def reduce_rows(x: torch.Tensor, table: torch.Tensor, first: int, row: int,
                located: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
                keep: Optional[torch.Tensor] = None) -> None:
    """The rows of `row` elements of flat `x` (ceil(numel / row) of them) reduced into table[first:], each row: the
    sum, sum of squares and sum of absolute values of its finite values, their min and max (+inf and
    -inf where none), its NaN count, the elements past x's end counted as NaN as the staged rows'
    padding is, and its finite count; and, with `located` (base, cols, sketch, slot), x's finite
    values added into sketch[slot] ([K] float64), x's element (r, c) (its rows of len(cols)) at
    base[r] + cols[c] in the whole (int64 on x's device). None: the statistics alone
    (bench/bench_sketch.py's baseline). `keep`: a bool on the device; where false, x is not read and
    its rows read as NaN, its sketch as zero (a record the writer throws away: grad_reads.py)."""
    rows = -(-x.numel() // row)
    base, cols, sketch, slot = located or (table, table[:1], table, 0)  # not read without the sketch
    if rows:
        _row_stats[(rows,)](x, x.numel(), table, first, base, cols, cols.numel(), sketch, slot,
                            table if keep is None else keep, ROW=row, SUB=SUB, SLICES=SLICES,
                            WIDE=cols.numel() >= row, SKETCH=located is not None, KEEP=keep is not None, num_warps=8)
