"""Reading the pairs and handing them to the judge, on a thread pool within a memory budget.

Pairs are compared on a thread pool: torch's kernels release the GIL, and only the pairs being
worked on are in memory. A big pair is cut into chunks of rows that the pool takes like pairs,
their sums merged in order: whole, the few largest pairs were each read by one thread while the
others idled (38% of the workers' time on the 8B-wide model's 60 GiB pair, py-spy on the H200).
"""

from __future__ import annotations

import itertools
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from megalign.compare import absent
from megalign.compare.buffers import BufferPool, check_fits
from megalign.compare.entries import Entry, Source, Value, Window
from megalign.compare.fused import Sums
from megalign.compare.judge import Rules, judge_apart, judge_one_sided, judge_pair
from megalign.compare.matching import Pair
from megalign.compare.metrics import TensorMetrics, metrics_of, pair_sums
from megalign.compare.rank_rows import rank_rows
from megalign.compare.records import BY_OP_MAP, BY_PATTERN, Row, Verdict
from megalign.dump.format import Kind

# Pairs with a side over STREAM_BYTES are compared a window of about WINDOW_BYTES at a time (rows
# of dim 0, or where one row is larger, runs of a deeper dim within it), in chunks of CHUNK_WINDOWS
# windows that the workers take apart (Execution.chunks).
STREAM_BYTES, WINDOW_BYTES, CHUNK_WINDOWS = 64 << 20, 16 << 20, 4

Span = Optional[tuple[Window, ...]]  # a chunk of a big pair's windows; None: the pair whole


class Execution:
    """What every pair of one comparison is read with: the sources, the judge's rules, the reference."""

    def __init__(self, a: Source, b: Source, pairs: list[Pair], rules: Rules, reference: Optional[Source] = None,
                 missable: Optional[re.Pattern] = None):
        self.pairs, self.rules, self.missable = pairs, rules, missable
        self.in_reference = {(e.kind, e.name): e for e in reference.entries} if reference else {}
        self.sides_a, self.sides_b = absent.OtherSide.of(a, b), absent.OtherSide.of(b, a)  # seen from a row of A / of B
        self.layouts = [source.dump.layout if source.dump is not None else None for source in (a, b)]
        # Enough for the largest pair compared whole, and at least the largest tensor's size, so that
        # many cores compare many pairs side by side while memory stays within twice the largest tensor.
        largest = max((e.nbytes or 0 for p in pairs for e in (p.a, p.b) if e is not None), default=0)
        self.buffers = BufferPool(max(largest, *map(self.lease_bytes, pairs), 0))

    def rows(self, workers: int) -> list[Row]:
        """Every pair's row, in order: pairs compared whole and chunks of big ones on one pool."""
        tasks = [(index, pair, span) for index, pair in enumerate(self.pairs) for span in self.chunks(pair)]
        # The pool is the parallelism: torch's own intra-op threads on top of it oversubscribe the
        # cores, and spinning OpenMP threads made a 2-core comparison 8x slower when measured.
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                done = list(pool.map(lambda task: self._task(*task), tasks))
        finally:
            torch.set_num_threads(torch_threads)
        rows: dict[int, Row] = {}
        chunks: dict[int, list[tuple[tuple[Window, ...], _Chunk]]] = {}
        for (index, pair, span), result in zip(tasks, done):
            if span is None:
                rows[index] = result
            else:
                chunks.setdefault(index, []).append((span, result))
        for index, parts in chunks.items():
            rows[index] = self._row(index, self.pairs[index], self._merged(self.pairs[index], parts))
        return [rows[index] for index in range(len(self.pairs))]

    def chunks(self, pair: Pair) -> list[Span]:
        """[None] for a pair compared whole; a big pair's windows, CHUNK_WINDOWS a chunk."""
        windows = self.windows(pair)
        if not windows:
            return [None]
        return [tuple(windows[start:start + CHUNK_WINDOWS]) for start in range(0, len(windows), CHUNK_WINDOWS)]

    def lease_bytes(self, pair: Pair) -> int:
        """What a pair leases: both sides whole, or a window of each, where they are read into buffers."""
        if pair.a is None or pair.b is None or pair.a.apart or pair.b.apart:
            return 0
        windows = self.windows(pair)
        if windows:
            return sum(_window_bytes(entry, windows[0]) for entry in (pair.a, pair.b))
        return (pair.a.nbytes or 0) + (pair.b.nbytes or 0)

    def windows(self, pair: Pair) -> list[Window]:
        """The boxes a pair is read in, one after another in the tensor's order, each of about
        WINDOW_BYTES of the larger side, where it is compared a window at a time, else []: big tensors
        whose elements are only compared one by one (no logprobs, routing or reference). Runs of rows of
        dim 0, or, where a row is larger (attention weights [batch, heads, seq, seq], logits [batch,
        seq, vocab]), runs of the first dim whose slices fit, within one index of the dims before it:
        read by rows of dim 0, a tensor of two rows was one window of half of it, leased whole by one
        worker while the others waited for the memory (py-spy: 29% of the workers' time)."""
        a, b = pair.a, pair.b
        if a is None or b is None or a.apart or b.apart or not (a.nbytes and b.nbytes) or \
                max(a.nbytes, b.nbytes) < STREAM_BYTES or a.shape != b.shape or not a.shape or \
                pair.kind in (Kind.LOGPROBS, Kind.ROUTING) or (pair.kind, pair.name) in self.in_reference:
            return []
        shape, itemsize = a.shape, max(a.nbytes, b.nbytes) // math.prod(a.shape)
        dim = next(d for d in range(len(shape)) if math.prod(shape[d + 1:]) * itemsize <= WINDOW_BYTES or
                   d == len(shape) - 1)
        step = max(1, WINDOW_BYTES // (math.prod(shape[dim + 1:]) * itemsize))
        return [(*((i, i + 1) for i in index), (start, min(start + step, shape[dim])))
                for index in itertools.product(*map(range, shape[:dim])) for start in range(0, shape[dim], step)]

    def _task(self, index: int, pair: Pair, span: Span) -> Union[Row, "_Chunk"]:
        return self._row(index, pair, self._whole(pair)) if span is None else self._chunk(pair, span)

    @staticmethod
    def _row(index: int, pair: Pair, verdict: Verdict) -> Row:
        return Row.of(index, pair.kind, pair.name, pair.layer, verdict)

    def _whole(self, pair: Pair) -> Verdict:
        """The verdict of a pair read whole (or one-sided, or set apart)."""
        if pair.a is None or pair.b is None:
            return self._one_sided(pair)
        apart = pair.a.apart or pair.b.apart
        if apart:
            return judge_apart(pair.a.shape, pair.b.shape, apart)
        check_fits(self.lease_bytes(pair), f"comparing {pair.kind} {pair.name}")
        with self.buffers.lease(pair.a.nbytes, pair.b.nbytes) as (buffer_a, buffer_b):
            return self._judged(pair, _load(pair.a, buffer_a), _load(pair.b, buffer_b))

    def _one_sided(self, pair: Pair) -> Verdict:
        entry = pair.a or pair.b
        sides = self.sides_a if pair.b is None else self.sides_b
        allowed = BY_OP_MAP if absent.op_map(entry.kind, pair.name, sides) else \
            BY_PATTERN if self.missable is not None and self.missable.search(pair.name) else None
        shape, dtype = entry.shape, entry.dtype
        if shape is None:
            value = entry.load()
            shape, dtype = value.shape, value.dtype
        return judge_one_sided(pair.a is not None, shape, dtype, absent.reason(entry.kind, pair.name, sides), allowed)

    def _judged(self, pair: Pair, x: Value, y: Value, metrics: Optional[TensorMetrics] = None) -> Verdict:
        """The judge's verdict, with the reference's value where both sides hold values or sketches
        (not a big pair compared a window at a time, whose Values hold neither)."""
        r = self.in_reference.get((pair.kind, pair.name))
        truth = r.load() if r is not None and all(side.tensor is not None or side.sketch is not None
                                                  for side in (x, y)) else None
        return judge_pair(pair.kind, pair.name, x, y, self.rules, truth=truth, metrics=metrics,
                          rows=rank_rows(pair, *self.layouts))

    def _chunk(self, pair: Pair, windows: tuple[Window, ...]) -> "_Chunk":
        """The sums of a run of a big pair's windows, read one at a time into two buffers of a window
        each: the sums of the windows add up to the whole's (metrics.metrics_of), whatever the
        tensor's size. Stops at the first window that cannot be put back together."""
        check_fits(self.lease_bytes(pair), f"comparing {pair.kind} {pair.name}")
        shape = pair.a.shape
        chunk = _Chunk(values=[Value(shape=shape, dtype=entry.dtype) for entry in (pair.a, pair.b)])
        sizes = [_window_bytes(entry, windows[0]) for entry in (pair.a, pair.b)]
        with self.buffers.lease(*sizes) as buffers:
            for window in windows:
                x, y = (entry.load(buffer=buffer, window=window) for entry, buffer in zip((pair.a, pair.b), buffers))
                chunk.add_values(x, y)
                if chunk.problem:
                    break
                chunk.sums.add(pair_sums(x.tensor, y.tensor), _offset(shape, window) - _offset(shape, windows[0]))
        return chunk

    def _merged(self, pair: Pair, chunks: list[tuple[tuple[Window, ...], "_Chunk"]]) -> Verdict:
        """A big pair's verdict from its chunks, merged in order up to the first with a problem."""
        whole = _Chunk(values=[Value(shape=pair.a.shape, dtype=entry.dtype) for entry in (pair.a, pair.b)])
        for windows, chunk in chunks:
            whole.add_values(*chunk.values)
            whole.sums.add(chunk.sums, _offset(pair.a.shape, windows[0]))
            if whole.problem:
                break
        return self._judged(pair, *whole.values, metrics=metrics_of(whole.sums, pair.a.shape))


@dataclass
class _Chunk:
    """What a run of rows of a big pair adds to its row: the sums, and each side's Value without a
    tensor (its problem, its replicas' gaps)."""

    values: list[Value]
    sums: Sums = field(default_factory=Sums)

    @property
    def problem(self) -> bool:
        return any(value.problem for value in self.values)

    def add_values(self, x: Value, y: Value) -> None:
        for whole, part in zip(self.values, (x, y)):
            whole.problem = part.problem
            whole.add_replicas(part)


def _window_bytes(entry: Entry, window: Window) -> int:
    """The bytes of an entry's tensor inside `window`."""
    return entry.nbytes // math.prod(entry.shape) * math.prod(stop - start for start, stop in window) * \
        math.prod(entry.shape[len(window):])


def _offset(shape: list[int], window: Window) -> int:
    """The position, in the flattened tensor, of a window's first element."""
    return sum(start * math.prod(shape[dim + 1:]) for dim, (start, _) in enumerate(window))


def _load(entry: Entry, buffer: Optional[torch.Tensor]) -> Value:
    return entry.load() if buffer is None else entry.load(buffer=buffer)
