"""The device statistics' Triton kernel (stats.SummaryBatch, once `fused`): a tensor's rows of ROW
elements reduced where the tensor lies, in its own dtype, one program a row, into rows of a
[rows, 7] float32 table. Staged first into a float32 buffer instead, each tensor was read, written
and read again (three passes over every activation) and cost the step's thread three launches (a
slice, a copy, a fill) where this costs one.

A module of its own so that Triton is imported only where a device's statistics are taken (it ships
with torch's CUDA builds; `load()` says None where it is absent: the caller stages the rows).
Hand-written rather than torch.compile'd: a compiled function called a tensor at a time cost 0.1 to
0.5 ms of the step's thread a call (its guards), and cannot write into a table at an offset.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megalign.dump.stats import ROW  # the staged rows' width: both ways give the same rows

_kernel: Optional[Callable] = None


def load() -> Optional[Callable[[torch.Tensor, torch.Tensor, int], None]]:
    """`reduce(x, table, first)`: the rows of flat `x` (ceil(numel / ROW) of them) reduced into
    table[first:], each row: the sum, sum of squares and sum of absolute values of its finite values,
    their min and max (+inf and -inf where none), its NaN count, the elements past x's end counted
    as NaN as the staged rows' padding is, and its finite count. None without Triton."""
    global _kernel
    if _kernel is None:
        try:
            _kernel = _compile()
        except ImportError:
            return None
    return _kernel


def _compile() -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    import triton
    import triton.language as tl

    # Not specialised on the sizes (Triton would compile anew for each of 1, multiples of 16 and the rest).
    @triton.jit(do_not_specialize=["numel", "first"])
    def row_stats(x, numel, table, first, ROW: tl.constexpr):  # pragma: no cover - runs on a device
        row = tl.program_id(0).to(tl.int64)
        at = row * ROW + tl.arange(0, ROW)
        inside = at < numel
        value = tl.load(x + at, mask=inside, other=0.0).to(tl.float32)
        finite = inside & (value == value) & (tl.abs(value) != float("inf"))
        kept = tl.where(finite, value, 0.0)
        nan = inside & (value != value)
        out = table + (first + row) * 7
        tl.store(out, tl.sum(kept, 0))
        tl.store(out + 1, tl.sum(kept * kept, 0))
        tl.store(out + 2, tl.sum(tl.abs(kept), 0))
        tl.store(out + 3, tl.min(tl.where(finite, value, float("inf")), 0))
        tl.store(out + 4, tl.max(tl.where(finite, value, -float("inf")), 0))
        tl.store(out + 5, tl.sum(nan.to(tl.float32), 0) + tl.sum((~inside).to(tl.float32), 0))
        tl.store(out + 6, tl.sum(finite.to(tl.float32), 0))

    def reduce(x: torch.Tensor, table: torch.Tensor, first: int) -> None:
        rows = -(-x.numel() // ROW)
        if rows:
            row_stats[(rows,)](x, x.numel(), table, first, ROW=ROW, num_warps=8)

    return reduce
