"""The device statistics' Triton kernel (stats.SummaryBatch, once `fused`): a tensor's rows of `row`
elements reduced where the tensor lies, in its own dtype, one program a row, into rows of a [rows, 7]
float32 table, and, in the same pass, each finite value added into the tensor's CountSketch
(sketch.py). The width is stats.ROW, passed in by stats (the rule is stats', and this module, which
stats loads, imports of megalign only sketch.py's constants). Staged first into a float32 buffer
instead, each tensor was read, written and read again (three passes over every activation) and cost
the step's thread three launches (a slice, a copy, a fill) where this costs one; the sketch by
torch's ops was about twenty-five kernels over int64 temporaries a tensor, and stats-only loops took
4.3x (hidden 4096) to 8.6x (hidden 1024) the loop (docs/gpu.md, H100).

The sketch's budget. At an H100's 3.35 TB/s a bf16 element arrives every 0.6 ps, in which the card
issues about 20 lane instructions (3.3e13 a second); the statistics alone take 41 an element
(compiled for sm_90, counted in the SASS), which is why bf16 ran at 1.25 TB/s, not 3.35. Counted
the same way:
- the hash (splitmix64's finalizer: two 64-bit multiplies, three 64-bit xor-shifts), the element's
  place in the whole and one float64 atomic add (RED) an element into its bucket: 60 more;
- summing the buckets by the tensor cores instead (bucket = 16 hi + lo; [hi one-hot x four exact
  11-bit slices of the value] @ [lo one-hot] in float16, exact in float32, then float64), whose
  operands go through shared memory: about 940 more. A dense one-hot ([elements, 128] compare,
  select, add): 384 by arithmetic alone.
So each element is added by one atomic: exact (float64, as the host's; only the order of the sums
differs), and bound by L2's atomic rate (one an L2 slice a clock, about 1.4e11 a second if spread
over the slices) or the ALU (about 3e11 elements a second), not by memory: a few times the
statistics' own time, expected; bench/bench_sketch.py measures it on the card. At hidden 1024 the
statistics alone were 1.67 ms of a 35.7 ms step (docs/gpu.md, H100): a kernel of 2.4x their
instructions adds about 2.3 ms, stats-only near 1.15x that loop, not 1.05x; at hidden 4096 the
statistics cost the step about 1% (stats-only 1.01x, H200), the sketch a few percent more there.
Spread: program p adds into copy p % copies of its tensor's buckets (stats.COPIES of them, summed at take()), so that
a tensor's atomics fall on many L2 slices; a single [128] slot is 1 KiB, one or two slices, and
serialises every atomic of the tensor there.

Where the element lies in the whole: element i of the flat shard is (r, c) = divmod(i, width), at
base[r] + cols[c] (sketch.rows_and_cols). A program divides its first index once; an element's
offset from there is below `width + ROW`, so its row is the same or the next (width >= ROW), or
comes from a float32 multiply by 1/width: exact, the quotient's margin of 0.5/(width + ROW) >= 6e-5
far above float32's error of 2.4e-7.

A module of its own so that Triton is imported only where a device's statistics are taken (it ships
with torch's CUDA builds; where it is absent, importing this module raises ImportError and the
caller stages the rows and takes the sketch by torch's ops).
Hand-written rather than torch.compile'd: a compiled function called a tensor at a time cost 0.1 to
0.5 ms of the step's thread a call (its guards), and cannot write into a table at an offset.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megalign.dump.sketch import K, M1, M2, SEED

# What a kernel may read of a module: constexpr globals.
_SEED, _M1, _M2, _K = tl.constexpr(SEED), tl.constexpr(M1), tl.constexpr(M2), tl.constexpr(K)


@triton.jit
def _combine(sum_a, sq_a, abs_a, low_a, high_a, nan_a, finite_a,
             sum_b, sq_b, abs_b, low_b, high_b, nan_b, finite_b):  # pragma: no cover - runs on a device
    return (sum_a + sum_b, sq_a + sq_b, abs_a + abs_b, tl.minimum(low_a, low_b), tl.maximum(high_a, high_b),
            nan_a + nan_b, finite_a + finite_b)


@triton.jit
def _sketch_row(kept, finite, start, base, cols, width, buckets, ROW: tl.constexpr,
                WIDE: tl.constexpr):  # pragma: no cover - runs on a device
    """The row's finite values (`kept`, from flat `start` on) added into `buckets` ([K] float64),
    each at its place in the whole hashed to a bucket and a sign."""
    first_row = start // width
    first_col = start - first_row * width
    if WIDE:  # width >= ROW: the same row or the next
        col = first_col + tl.arange(0, ROW)
        down = (col >= width).to(tl.int32)
    else:  # below 2 * ROW: int32, and the row through float32
        col = first_col.to(tl.int32) + tl.arange(0, ROW)
        down = ((col.to(tl.float32) + 0.5) * (1.0 / width.to(tl.float32))).to(tl.int32)
    col -= down * width
    g = tl.load(base + first_row + down, mask=finite, other=0) + tl.load(cols + col, mask=finite, other=0)
    x = g.to(tl.uint64, bitcast=True) + _SEED
    x = (x ^ (x >> 30)) * _M1
    x = (x ^ (x >> 27)) * _M2
    h = x ^ (x >> 31)
    signed = tl.where((h >> 63) != 0, -kept, kept).to(tl.float64)
    tl.atomic_add(buckets + (h & (_K - 1)).to(tl.int32), signed, mask=finite, sem="relaxed")


# The seven reductions in one (tl.reduce of a tuple): 2.66 TB/s on an H100's float32, 93% of torch's
# sum, and 1.25 on bfloat16; seven tl.sum and tl.min apart, 2.07 and 0.85 (one H100 call, docs/gpu.md).
# Not specialised on the sizes (Triton would compile anew for each of 1, multiples of 16 and the rest).
@triton.jit(do_not_specialize=["numel", "first", "width", "slot"])
def _row_stats(x, numel, table, first, base, cols, width, sketch, slot, keep, ROW: tl.constexpr, WIDE: tl.constexpr,
               SKETCH: tl.constexpr, KEEP: tl.constexpr, COPIES: tl.constexpr):  # pragma: no cover - on a device
    row = tl.program_id(0).to(tl.int64)
    out = table + (first + row) * 7
    go = True
    if KEEP:
        go = tl.load(keep).to(tl.int32) != 0
    if go:
        at = row * ROW + tl.arange(0, ROW)
        inside = at < numel
        value = tl.load(x + at, mask=inside, other=float("nan")).to(tl.float32)
        finite = inside & (value == value) & (tl.abs(value) != float("inf"))
        kept = tl.where(finite, value, 0.0)
        total, sum_sq, abs_sum, low, high, nan, count = tl.reduce(
            (kept, kept * kept, tl.abs(kept), tl.where(finite, value, float("inf")),
             tl.where(finite, value, -float("inf")), (value != value).to(tl.float32), finite.to(tl.float32)),
            0, _combine)
        _store(out, total, sum_sq, abs_sum, low, high, nan, count)  # the NaN: x's, and the elements past its end
        if SKETCH:
            _sketch_row(kept, finite, row * ROW, base, cols, width,
                        sketch + (slot * COPIES + row % COPIES) * _K, ROW, WIDE)
    else:  # a record to be thrown away: not read, every element NaN (as padding is), no sketch
        _store(out, 0.0, 0.0, 0.0, float("inf"), -float("inf"), 1.0 * ROW, 0.0)


@triton.jit
def _store(out, total, sum_sq, abs_sum, low, high, nan, count):  # pragma: no cover - runs on a device
    tl.store(out, total)
    tl.store(out + 1, sum_sq)
    tl.store(out + 2, abs_sum)
    tl.store(out + 3, low)
    tl.store(out + 4, high)
    tl.store(out + 5, nan)
    tl.store(out + 6, count)


def reduce_rows(x: torch.Tensor, table: torch.Tensor, first: int, row: int,
                located: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
                keep: Optional[torch.Tensor] = None) -> None:
    """The rows of `row` elements of flat `x` (ceil(numel / row) of them) reduced into table[first:], each row: the
    sum, sum of squares and sum of absolute values of its finite values, their min and max (+inf and
    -inf where none), its NaN count, the elements past x's end counted as NaN as the staged rows'
    padding is, and its finite count; and, with `located` (base, cols, sketch, slot), x's finite
    values added into sketch[slot] (sketch: [slots, copies, K] float64, zero first; slot's copies
    summed: x's sketch),
    x's element (r, c) (its rows of len(cols)) at base[r] + cols[c] in the whole (int64 on x's
    device). None: the statistics alone (bench/bench_sketch.py's baseline). `keep`: a bool on the
    device; where false, x is not read and reads as NaN, its sketch zero (a record the writer throws
    away: grad_reads.py)."""
    rows = -(-x.numel() // row)
    base, cols, sketch, slot = located or (table, table[:1], table, 0)  # not read without the sketch
    if rows:
        _row_stats[(rows,)](x, x.numel(), table, first, base, cols, cols.numel(), sketch, slot,
                            table if keep is None else keep, ROW=row, WIDE=cols.numel() >= row,
                            SKETCH=located is not None, KEEP=keep is not None, COPIES=sketch.shape[1] if located else 1,
                            num_warps=8)
