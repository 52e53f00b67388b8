"""Per-tensor statistics for `--stats-only` dumps.

Only sums, extremes and counts are stored, so that the statistics of a sharded tensor can be
combined from its shards exactly as the tensor itself would be reassembled.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, fields
from typing import Callable, Iterable, Optional, Union

import numpy as np
import torch

from megalign.dump.sketch import K, device_sketch, queued, rows_and_cols

CHUNK = 1 << 20  # elements summed at a time on a CPU (4 MiB of float32)


@dataclass(frozen=True)
class TensorStats:
    numel: int
    sum: float
    sum_sq: float
    abs_sum: float
    min: float
    max: float
    nan: int
    inf: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorStats":
        """On a CPU, one compiled pass a chunk, every sum in float64 (_host_stats). On a device, sums
        accumulate in float32 through torch's cascade summation and in float64 across chunks (about
        1e-7 relative; seen: 1e-7 on 2e7 normal values). vector_norm is avoided: its float32
        accumulation lost 0.2% on the same values."""
        x = summable(tensor.detach().flatten())
        if x.device.type == "cpu":
            return cls(tensor.numel(), *_host_stats(x))
        total, sum_sq, abs_sum = _sums(x)
        nan = inf = 0
        if not (math.isfinite(total) and math.isfinite(sum_sq)):  # a NaN or Inf somewhere (or overflow)
            nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            x = x[torch.isfinite(x)].to(torch.float64)
            total, sum_sq, abs_sum = _sums(x)
        if x.numel() == 0:  # empty, or nothing finite
            return cls(numel=tensor.numel(), sum=0.0, sum_sq=0.0, abs_sum=0.0, min=math.nan, max=math.nan,
                       nan=nan, inf=inf)
        low, high = torch.aminmax(x)
        return cls(numel=tensor.numel(), sum=total, sum_sq=sum_sq, abs_sum=abs_sum, min=float(low), max=float(high),
                   nan=nan, inf=inf)

    @classmethod
    def from_summary(cls, numel: int, summary: list[float]) -> "TensorStats":
        """From a SummaryBatch's values, read back."""
        total, sum_sq, abs_sum, low, high, nan, inf = summary
        if nan + inf == numel:  # empty, or nothing finite
            low = high = math.nan
        return cls(numel=numel, sum=total, sum_sq=sum_sq, abs_sum=abs_sum, min=low, max=high, nan=int(nan), inf=int(inf))

    @classmethod
    def combine(cls, shards: Iterable["TensorStats"]) -> "TensorStats":
        shards = list(shards)
        return cls(numel=sum(s.numel for s in shards), sum=sum(s.sum for s in shards),
                   sum_sq=sum(s.sum_sq for s in shards), abs_sum=sum(s.abs_sum for s in shards),
                   min=min(s.min for s in shards), max=max(s.max for s in shards),
                   nan=sum(s.nan for s in shards), inf=sum(s.inf for s in shards))

    @property
    def mean(self) -> float:
        return self.sum / max(self.numel, 1)

    @property
    def all_zero(self) -> bool:
        """Every element 0 (or none): what count_nonzero would say, from the extremes, which are exact."""
        return self.numel == 0 or (self.min == 0 and self.max == 0 and self.nan == 0 and self.inf == 0)

    @property
    def norm(self) -> float:
        return math.sqrt(self.sum_sq)

    @property
    def std(self) -> float:
        n = max(self.numel, 1)
        return math.sqrt(max(self.sum_sq / n - self.mean ** 2, 0.0))

    def to_dict(self) -> dict:
        # Not dataclasses.asdict, which deep-copies each value: 8% of a stats-only training loop's time.
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, raw: dict) -> "TensorStats":
        return cls(**raw)


_FIELDS = tuple(field.name for field in fields(TensorStats))


def summable(x: torch.Tensor) -> torch.Tensor:
    """`x` in a dtype torch sums and takes extremes of: integers and bools as float64 (token ids and
    masks: small, and exact so), float8 as float32 (aminmax has no float8 kernel)."""
    if not x.is_floating_point():
        return x.double()
    return x.float() if x.itemsize == 1 else x


def _sums(x: torch.Tensor) -> tuple[float, float, float]:
    """Sum, sum of squares and sum of absolute values of a flat device tensor, in the accumulating
    dtype (bf16 squared in bf16 would round every square)."""
    buffer = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return float(buffer.sum()), float(buffer.mul(buffer).sum()), float(buffer.abs().sum())


def host_summary(tensor: torch.Tensor, base: torch.Tensor, cols: torch.Tensor) -> tuple[TensorStats, np.ndarray]:
    """A CPU tensor's statistics and its sketch (sketch.py), in one pass: its element (r, c) (its
    last dim the columns) lies at base[r] + cols[c] in the whole tensor."""
    sketch = np.zeros(K, dtype=np.float64)
    stats = TensorStats(tensor.numel(), *_host_stats(summable(tensor.detach().flatten()),
                                                     (base.numpy(), cols.numpy(), sketch)))
    return stats, sketch


def summary_of(tensor: torch.Tensor) -> tuple[TensorStats, np.ndarray]:
    """A whole tensor's statistics and sketch (a full dump's, judged against a stats-only one's): one
    pass on a CPU."""
    base, cols = rows_and_cols(tuple(tensor.shape), [torch.arange(n) for n in tensor.shape], tensor.device)
    if tensor.device.type == "cpu":
        return host_summary(tensor, base, cols)
    sketch = device_sketch(summable(tensor.detach().reshape(-1)), base, cols,
                           torch.zeros(K, dtype=torch.float64, device=tensor.device))
    return TensorStats.of(tensor), sketch.cpu().numpy()


def _host_stats(x: torch.Tensor, sketch: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
                ) -> tuple[float, float, float, float, float, int, int]:
    """(sum, sum of squares, sum of |x|, min, max) over a flat CPU tensor's finite values, its NaN and
    Inf counts; with `sketch` (base, cols, the sketch), x's finite values added into the sketch in the
    same pass (host_kernels.sums_and_sketch: 2.3 ms on 1M float32 where fast_sums takes 0.15, the hash's
    2 ns an element; unvectorized, as the buckets are scattered). CHUNK elements at a time, bf16 and
    fp16 widened into one reused float32 buffer (numpy has no bf16; a whole-tensor copy costs a page
    fault per 4 KiB). The sums in one compiled pass and the extremes by torch's aminmax, not torch's
    reductions: seven of them a tensor, each with its dispatch, were 25% of a stats-only training loop's
    time on a CPU (cProfile, bench_trainer's model). The extremes are not in the compiled loop: a min
    and max there keep LLVM from vectorizing it (7x slower, measured). aminmax is one pass on every
    core: 2.3x as fast as numpy's min and max on 1M elements, 1.4x on 4K, level on 32K (2 cores)."""
    # numba: imported where first needed
    from megalign.dump.host_kernels import careful_stats, fast_sums, sums_and_sketch

    total = sum_sq = abs_sum = 0.0
    low, high, nan, inf = math.inf, -math.inf, 0, 0
    widen = x.dtype not in (torch.float32, torch.float64)
    scratch = torch.empty(min(CHUNK, x.numel()), dtype=torch.float32) if widen else None
    for start in range(0, x.numel(), CHUNK):
        piece = x[start:start + CHUNK]
        values = (scratch[:piece.numel()].copy_(piece) if widen else piece).numpy()
        sums = fast_sums(values) if sketch is None else sums_and_sketch(values, start, *sketch)
        part = (*sums, *map(float, torch.aminmax(piece)), 0, 0)
        if not (math.isfinite(part[0]) and math.isfinite(part[1])):  # a NaN or Inf here (or overflow)
            part = careful_stats(values)
        total, sum_sq, abs_sum = total + part[0], sum_sq + part[1], abs_sum + part[2]
        low, high, nan, inf = min(low, part[3]), max(high, part[4]), nan + part[5], inf + part[6]
    if nan + inf == x.numel():  # empty, or nothing finite
        low = high = math.nan
    return total, sum_sq, abs_sum, low, high, nan, inf


ROW = 4096  # elements reduced together first: the rows side by side, then their results
SUMMARY = 7  # the values of a tensor's summary (TensorStats.from_summary)
SKETCHES = 256  # tensors of a sketch table
COPIES = 32  # copies of a tensor's buckets in it, which the Triton kernel spreads its atomic adds over (8 MiB a table)
# Elements summarised after which the Triton kernel is used even in a run's first step (the tensor that
# passes it included). The eager path costs about twenty kernels over int64 temporaries a block (some
# 300 bytes of traffic an element, 70 ps on an H200) where the kernel costs a few. Its compilation,
# about a second a dtype, is repaid by about 1.5e10 elements, but only the first run on a machine pays
# it in full: Triton keeps the compiled kernel on disk, and megalign's runs come several at a time (a
# check's four), so the bar is set lower. A one-step run of a large model summarises far more (an 8B
# model's backward at 2x4096 tokens: 1.4e11, its attention probabilities most), a tiny one far less.
FUSED_AFTER = 1 << 31


class SummaryBatch:
    """Device statistics and sketches of many tensors, taken together and queued without waiting for
    them (a read-back a value would stall the step). Each tensor's rows of ROW elements are reduced
    into a table of [rows, 7] float32, and when the summaries are taken every row since is combined,
    in float64, into each tensor's: the sum, sum of squares and sum of absolute values of its finite
    values, their min and max, and its NaN and Inf counts (TensorStats.from_summary); beside them its
    sketch (sketch.py), K float64 values: the tensor's row of a sketch table, COPIES copies of its
    buckets summed at take.

    `fused` (from a training loop's second step, or once FUSED_AFTER elements have been added: the
    kernel's compilation, about a second a dtype, pays off over a loop or a large model's step, not in
    a small run of one step): each tensor is reduced and sketched where it
    lies, in its own dtype, in one pass by one Triton kernel (device_kernels.py). Otherwise, or
    without Triton, each is copied as float32 into a staging buffer of `rows` rows, NaN after it in
    its last row (one larger goes in as pieces of a buffer each), and the buffer's rows are reduced
    by a dozen eager kernels when it is full, its sketch taken by torch's ops (sketch.device_sketch).
    float64 tensors are reduced and sketched alone, in float64. Taken a tensor at a time, each
    tensor was twenty eager kernels or a compiled call of 0.5 ms of the step's thread (py-spy, a
    4-layer HF Llama on an H100); staged, its copy read and wrote every element once more and cost
    three launches (the slice, copy and fill) where the kernel costs one.

    Nothing here waits for the device: the host's part (which rows are whose) is copied from
    page-locked memory behind the step's kernels (sketch.queued), and nothing is indexed by a Python list
    (a list index is a copy from pageable memory, which waits for the whole queue: 20 stalls a step
    of that 4-layer Llama, torch.cuda.set_sync_debug_mode)."""

    def __init__(self, rows: int = 8192):  # 32M elements: 128 MiB of float32
        self.rows = rows
        self.fused = False
        self._buffer: Optional[torch.Tensor] = None  # staged rows
        self._used = 0  # rows of the buffer holding pieces not yet reduced
        self._staged = 0  # pieces in the buffer not yet reduced (an empty one holds no row)
        self._table: Optional[torch.Tensor] = None  # [rows, 7]: the rows reduced where they lie
        self._filled = 0  # rows of the table written
        self._reduced: list[torch.Tensor] = []  # [rows, 7] statistics of every row reduced since the last take
        self._pieces: list[tuple[int, int, int]] = []  # (tensor, elements, rows) of each piece, in row order
        self._sketches: list[torch.Tensor] = []  # [SKETCHES, COPIES, K] float64, zeroed: tensor i's in row i
        self._tensors = 0  # added since the last take
        self._elements = 0  # added in all

    def add(self, tensor: torch.Tensor, base: torch.Tensor, cols: torch.Tensor,
            keep: Optional[torch.Tensor] = None) -> None:
        """A detached tensor (the writer's), its element (r, c) (its last dim the columns) at
        base[r] + cols[c] in the whole (sketch.rows_and_cols, on its device). `keep`: a bool on the
        device, false where its record will be thrown away: the kernel then skips it, and it reads as
        nothing but NaN (the other ways take it whatever the flag)."""
        x = summable(tensor.reshape(-1))
        owner, self._tensors = self._tensors, self._tensors + 1
        self._elements += x.numel()
        table = self._sketch_table(owner, x.device)
        if x.dtype == torch.float64:  # kept exact: its rows reduced now, in float64
            self._reduce()
            n, rows = x.numel(), -(-x.numel() // ROW)
            self._reduced.append(_row_stats(torch.nn.functional.pad(x, (0, rows * ROW - n), value=math.nan)
                                            .view(rows, ROW)))
            self._pieces.append((owner, n, rows))
            device_sketch(x, base, cols, table[owner % SKETCHES, 0])
            return
        fused = self.fused or self._elements > FUSED_AFTER
        if fused and runs_here(x) and self._reduce_in_place(owner, x, base, cols, keep):
            return
        device_sketch(x, base, cols, table[owner % SKETCHES, 0])
        size = self.rows * ROW
        if x.numel() <= size:  # most: one piece, the tensor itself (a slice costs the step's thread)
            self._stage(owner, x)
            return
        for start in range(0, x.numel(), size):
            self._stage(owner, x[start:start + size])

    def take(self) -> Optional[torch.Tensor]:
        """Every summary since the last take, [tensors, 7 + K] float64 on the device, in the order
        added: the statistics, then the sketch."""
        self._reduce()
        reduced, pieces, count, sketches = self._reduced, self._pieces, self._tensors, self._sketches
        self._reduced, self._pieces, self._tensors, self._sketches = [], [], 0, []
        if not count:
            return None
        sketched = (torch.cat(sketches) if len(sketches) > 1 else sketches[0])[:count].sum(1)
        per_row = torch.cat(reduced).double() if reduced else sketched.new_zeros(0, 7)  # none: all empty
        return torch.cat([_summaries(per_row, pieces, count), sketched], 1)

    def _sketch_table(self, owner: int, device: torch.device) -> torch.Tensor:
        """The sketch table holding tensor `owner`'s buckets (its row owner % SKETCHES), zero: a table
        of SKETCHES tensors at a time, one fill for them all rather than one a tensor. The kernel
        takes the table and the row; a view of the row would be two more operators a record."""
        if owner // SKETCHES == len(self._sketches):
            self._sketches.append(torch.zeros(SKETCHES, COPIES, K, dtype=torch.float64, device=device))
        return self._sketches[owner // SKETCHES]

    def _reduce_in_place(self, owner: int, x: torch.Tensor, base: torch.Tensor, cols: torch.Tensor,
                         keep: Optional[torch.Tensor]) -> bool:
        """x's rows into the table and its sketch into its row by the Triton kernel; False where there
        is none (it stages them)."""
        reduce = _kernel()
        if reduce is None:
            return False
        if self._staged or self._buffer is not None:
            self._reduce()  # rows in order; and the staging buffer, of no more use, given back
            self._buffer = None
        rows = -(-x.numel() // ROW)
        if self._table is not None and (self._table.device != x.device or self._filled + rows > self._table.shape[0]):
            self._reduce()
            self._table = None  # rows too many for it, even with none written yet (empty tensors before)
        if self._table is None:
            self._table = torch.empty(max(self.rows, rows), 7, dtype=torch.float32, device=x.device)
        try:
            # the staged rows' width: both ways give the same rows
            reduce(x, self._table, self._filled, ROW, (base, cols, self._sketches[-1], owner % SKETCHES), keep)
        except Exception as error:  # a Triton that cannot compile here: the same values, staged
            _give_up(error)
            return False
        self._pieces.append((owner, x.numel(), rows))
        self._filled += rows
        return True

    def _stage(self, owner: int, x: torch.Tensor) -> None:
        n = x.numel()
        rows = -(-n // ROW)
        if self._filled or (self._buffer is not None and (self._buffer.device != x.device
                                                          or self._used + rows > self.rows)):
            self._reduce()
        if self._buffer is None or self._buffer.device != x.device:
            self._buffer = torch.empty(self.rows * ROW, dtype=torch.float32, device=x.device)
        start = self._used * ROW
        self._buffer[start:start + n].copy_(x)
        if n < rows * ROW:  # the last row's rest; a tensor of whole rows (most activations) has none
            self._buffer[start + n:start + rows * ROW].fill_(math.nan)
        self._pieces.append((owner, n, rows))
        self._used += rows
        self._staged += 1

    def _reduce(self) -> None:
        """The table's rows, or the staged rows reduced (one of them holds rows at a time), onto _reduced."""
        if self._filled:
            self._reduced.append(self._table[:self._filled])
            self._table, self._filled = None, 0
        if not self._staged:
            return
        rows = self._buffer.view(self.rows, ROW)[:self._used]
        self._reduced.append(_row_stats(rows))
        self._used = self._staged = 0


def _row_stats(rows: torch.Tensor) -> torch.Tensor:
    """[rows, ROW] -> [rows, 7]: each row's sum, sum of squares and sum of absolute values of its
    finite values, their min and max, its NaN count and its finite count."""
    finite = torch.isfinite(rows)
    kept = torch.where(finite, rows, 0)
    return torch.stack([kept.sum(1), (kept * kept).sum(1), kept.abs().sum(1),
                        torch.where(finite, rows, math.inf).amin(1), torch.where(finite, rows, -math.inf).amax(1),
                        torch.isnan(rows).sum(1).to(rows.dtype), finite.sum(1).to(rows.dtype)], 1)


def _summaries(per_row: torch.Tensor, pieces: list[tuple[int, int, int]], count: int) -> torch.Tensor:
    """Rows' statistics (float64) -> each of `count` tensors', [count, 7], for pieces of (tensor,
    elements, rows) whose rows lie one after another, the NaN padding after each piece left out of
    its tensor's NaN count. The pieces' numbers cross in one copy; each row's tensor is made on the
    device."""
    device = per_row.device
    owner, numel, rows = queued(torch.tensor(list(zip(*pieces)), dtype=torch.int64), device)
    grouped = _group(per_row, torch.repeat_interleave(owner, rows, output_size=per_row.shape[0]), count)
    numel, padding = torch.zeros(2, count, dtype=torch.float64, device=device).index_add_(
        1, owner, torch.stack([numel, rows * ROW - numel]).double())
    nan = grouped[:, 5] - padding
    return torch.cat([grouped[:, :5], nan[:, None], (numel - grouped[:, 6] - nan)[:, None]], 1)


def _group(values: torch.Tensor, owner: torch.Tensor, count: int) -> torch.Tensor:
    """[k, 7] statistics (three sums, min, max, two counts) -> [count, 7], row i into row owner[i]."""
    added = torch.zeros(count, 7, dtype=values.dtype, device=values.device).index_add_(0, owner, values)
    low = torch.full((count,), math.inf, dtype=values.dtype, device=values.device).scatter_reduce_(
        0, owner, values[:, 3], "amin")
    high = torch.full((count,), -math.inf, dtype=values.dtype, device=values.device).scatter_reduce_(
        0, owner, values[:, 4], "amax")
    return torch.cat([added[:, :3], low[:, None], high[:, None], added[:, 5:]], 1)


def runs_here(x: torch.Tensor) -> bool:
    """Whether the Triton kernel can take `x`: on a GPU, or on any device where Triton interprets
    its kernels (TRITON_INTERPRET=1: how its CPU tests run it)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


_loaded: Union[Callable, None, bool] = None  # device_kernels' reduce once loaded; False: none here


def _kernel() -> Optional[Callable]:
    global _loaded
    if _loaded is None:
        try:  # Triton: imported where a device's statistics are taken
            from megalign.dump.device_kernels import reduce_rows
        except ImportError:
            reduce_rows = False
        _loaded = reduce_rows
    return _loaded or None


def _give_up(error: Exception) -> None:
    global _loaded
    warnings.warn(f"megalign: device statistics are staged, the Triton kernel failed ({error})")
    _loaded = False
