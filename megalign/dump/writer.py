"""Writing one rank's tensors: safetensors files of about 256 MiB, then the rank's manifest.

The run waits only for each tensor's copy to host memory. Background threads write the files and
hash the bytes as they write them, so the run goes on while the disk works; a device tensor is
copied into pinned host memory asynchronously, and the writing thread waits for that copy, not the
run. A stable device tensor (a parameter gradient after the step) is not copied at all: the thread
streams it to its file through two pinned buffers (pinned.py). A device tensor's copy is made on
the device, within a room there that the run waits on when the disk falls behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from megalign.dump.format import (COMPACT, FORMAT, MANIFEST, VERSION, Kind, RankCoords, TensorRecord, dtype_name,
                                  rank_dirname, write_text_atomic)
from megalign.dump.sharding import Sharding
from megalign.dump.pinned import PinnedBuffers
from megalign.dump.layout import Layout
from megalign.dump.placement import positions
from megalign.dump.sketch import rows_and_cols
from megalign.dump.stats import SUMMARY, SummaryBatch, TensorStats, host_summary
from megalign.dump.tensorfile import STORED, unstorable, write_file

# One thread writes into the page cache at about one core's copy speed; files written side by side go
# faster (bench/bench_writer.py on the H200 host: 1.38x one sequential write with one thread, 0.49x
# with four). A quarter of the cores at most, since the run needs the rest: one thread on 7 or fewer.
WRITE_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 4))
SUMMARIES_PER_COPY = 256  # device statistics read back together
# The longest index vector _located keeps (512 KiB of int64): an activation's rows and hidden dim fit,
# a big 1-D tensor's columns do not.
CACHED_INDEXES = 1 << 16


def check_storable(kind: Kind, name: str, tensor: torch.Tensor) -> None:
    """TypeError, one line, where no dump can hold `tensor`: asked at every add(), so that such a tensor
    stops a run at its first add, not at close (the whole dump lost) or in a step chosen long into it."""
    refused = unstorable(tensor)
    if refused is not None:
        raise TypeError(f"{kind} {name}: megalign stores {STORED}; got {refused}")


class RankWriter:
    """Collects one rank's tensors and writes them in safetensors files of about `flush_bytes`."""

    def __init__(self, root: Path, coords: RankCoords, stats_only: bool = False,
                 name_filter: Optional[str] = None, flush_bytes: int = 256 << 20):
        self.dir = Path(root) / rank_dirname(coords.rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.coords = coords
        # Where this rank's shards lie in the whole, for their sketches (set by the Dumper as it learns
        # them): the layout, and where this rank's row was cut for CP's zigzag (None: a whole row).
        self.layout = Layout()
        self.bounds: Optional[tuple[int, ...]] = None
        self.stats_only = stats_only
        # Device statistics, taken together; through a Triton kernel once worth it (over many steps).
        self.summaries = SummaryBatch()
        self.filter = re.compile(name_filter) if name_filter else None
        self.flush_bytes = flush_bytes
        self.records: list[TensorRecord] = []
        self.bytes_written = 0  # of every file: known after close()
        # The file being filled: its records, what each is written from, and the event to wait for first.
        self._pending: list[tuple[TensorRecord, torch.Tensor, Optional[torch.cuda.Event]]] = []
        self._pending_bytes = 0
        self._pending_copies = 0  # bytes of them copied on the device
        self._files: list[Future] = []
        # --stats-only on a device: summaries queued behind the step's kernels, read back in batches
        # (one copy and one event each, filled in by a writing thread), the run never waiting on them.
        self._summarized: list[TensorRecord] = []
        self._unless_zero: list[TensorRecord] = []
        # Records kept only where their flag (a bool on the device) is true at close (kept_if): the
        # orders of each flag's, and the flag of those being added now.
        self._kept_if: list[tuple[list[int], torch.Tensor]] = []
        self._flag: Optional[torch.Tensor] = None
        self._left_out: set[int] = set()  # orders of records left out
        self._stats: list[Future] = []
        # Each record's manifest entry, as JSON, made by the writing thread that finished the record
        # (its statistics read back, its file hashed), by its order; the rest are made at close.
        # Made at close, they were 9 us a record there (2 cores): a stats-only step of 376 tensors
        # cost 3.4 ms more at close.
        self._entries: dict[int, str] = {}
        self._pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="megalign-writer")
        self._local = threading.local()  # each writing thread's own pinned buffers: .pinned
        self._error: Optional[BaseException] = None  # the first error a writing thread met
        # Device copies not yet written, and how many bytes of them the device may hold (set at the first).
        self._on_device = 0
        self._device_room: Optional[int] = None
        self._written = threading.Condition()  # notified as each file's device copies are released

    def wants(self, kind: str, name: str) -> bool:
        return kind == Kind.INPUT or self.filter is None or bool(self.filter.search(name))

    def add(self, kind: Kind, name: str, tensor: torch.Tensor, sharding: Sharding,
            module: Optional[str] = None, layer: Optional[int] = None, stable: bool = False,
            unless_zero: bool = False, call: Optional[int] = None, full: bool = False) -> None:
        """Record a tensor. `full`: its values even in a stats-only writer (a zoom's, dump/zoom.py). `stable`: it will not change before close() (parameter gradients after the
        step), so it is written from where it is; any other is copied now. `unless_zero` (stats-only):
        the record is left out at close if its statistics say the tensor is all zero. `call`: an
        activation gradient's forward call (TensorRecord.call). The Dumper has refused a tensor no dump
        can hold already (check_storable), whatever the name filter or the steps chosen."""
        if not self.wants(kind, name):
            return
        self._raise()
        tensor = tensor.detach()
        record = TensorRecord(kind=kind, name=name, order=len(self.records), shape=list(tensor.shape),
                              dtype=dtype_name(tensor.dtype), sharding=sharding, module=module, layer=layer,
                              call=call)
        if self._flag is not None:
            self._kept_if[-1][0].append(record.order)
        if self.stats_only and not full:
            if unless_zero:
                self._unless_zero.append(record)
            base, cols = _located(tuple(tensor.shape), sharding, self.coords, self.layout, self.bounds,
                                  tensor.device)
            if tensor.device.type == "cpu":
                # Here and now: a copy for a writing thread to sum costs a pass of its own, and the
                # thread takes the cores the run uses (stats-only 1.8x the loop without the Dumper,
                # against 3.0x so, bench_trainer.py on 2 cores).
                record.stats, record.sketch = host_summary(tensor, base, cols)
            else:
                self.summaries.add(tensor, base, cols, self._flag)
                self._summarized.append(record)
                if len(self._summarized) == SUMMARIES_PER_COPY:
                    self._read_summaries()
        else:
            record.key = str(record.order)
            held, ready, copied = self._held(tensor, stable)  # may write the file being filled first
            record.file = self._current_file()
            self._pending.append((record, held, ready))
            self._pending_bytes += tensor.nbytes
            self._pending_copies += tensor.nbytes if copied else 0
            if self._pending_bytes >= self.flush_bytes:
                self._flush()
        self.records.append(record)

    def close(self, extra: Optional[dict] = None) -> None:
        """Wait for every file, then write the manifest; raises what a writing thread met."""
        self._flush()
        self._read_summaries()
        self._pool.shutdown(wait=True)
        for done in self._stats:
            done.result()
        self._raise()
        self._left_out.update(record.order for record in self._unless_zero if record.stats.all_zero)
        if self._kept_if:  # the flags read back together, once
            kept = torch.stack([flag.to(self._kept_if[0][1].device) for _, flag in self._kept_if]).tolist()
            self._left_out.update(order for (orders, _), keep in zip(self._kept_if, kept) if not keep
                                  for order in orders)
        # Orders kept, gaps and all.
        self.records = [record for record in self.records if record.order not in self._left_out]
        self.bytes_written = sum(done.result() for done in self._files)
        head = json.dumps({
            "format": FORMAT, "version": VERSION, "rank": self.coords.rank, "tp_rank": self.coords.tp_rank,
            "cp_rank": self.coords.cp_rank, "pp_rank": self.coords.pp_rank, "dp_rank": self.coords.dp_rank,
            "bytes": self.bytes_written}, separators=COMPACT)
        tensors = ",".join(self._entries.get(record.order) or _entry(record) for record in self.records)
        tail = json.dumps(extra or {}, separators=COMPACT)[1:-1]
        write_text_atomic(self.dir / MANIFEST, f'{head[:-1]},"tensors":[{tensors}]{"," if tail else ""}{tail}}}')

    @contextlib.contextmanager
    def kept_if(self, flag: torch.Tensor) -> Iterator[None]:
        """Records added inside are kept only where `flag` (a bool, on a device: not waited for) is
        true at close; a device's statistics kernel skips them where it is false already."""
        self._flag = flag
        self._kept_if.append(([], flag))
        try:
            yield
        finally:
            self._flag = None

    def discard_from(self, order: int) -> None:
        """Leave out of the manifest every record from `order` on (a step that raised)."""
        self.discard(range(order, len(self.records)))

    def discard(self, orders: Iterable[int]) -> None:
        """Leave the records of `orders` out of the manifest (a step that raised, a read replaced by a
        later one). Bytes of theirs already in a file stay there, read by nothing."""
        self._left_out.update(orders)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing the dump into {self.dir.parent} failed: {self._error}") from self._error

    def _read_summaries(self) -> None:
        if self._summarized:
            records, self._summarized = tuple(self._summarized), []
            rows = self.summaries.take()
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self._stats.append(self._pool.submit(self._fill_stats, records, host, ready))

    def _current_file(self) -> str:
        return f"tensors-{len(self._files):05d}.safetensors"

    def _flush(self) -> None:
        if self._pending:
            path = self.dir / self._current_file()
            self._files.append(self._pool.submit(self._write_file, path, self._pending, self._pending_copies))
            self._pending, self._pending_bytes, self._pending_copies = [], 0, 0

    def _write_file(self, path: Path, pending: list, copies: int) -> int:
        """In a writing thread: one file (`copies` bytes of it copied on the device); returns its
        bytes of tensor data."""
        try:
            if self._error is not None:
                return 0  # after a failure nothing more is written
            for _, _, ready in pending:
                if ready is not None:
                    ready.synchronize()
            if not hasattr(self._local, "pinned"):
                self._local.pinned = PinnedBuffers()
            written, hashes = write_file(path, {record.key: held for record, held, _ in pending},
                                         self._local.pinned.pieces)
            for record, _, _ in pending:
                record.hash = hashes[record.key]
                self._entries[record.order] = _entry(record)
            return written
        except BaseException as e:  # noqa: B036 - handed to the run's thread, which raises it
            self._error = self._error or e
            return 0
        finally:
            with self._written:
                self._on_device -= copies
                self._written.notify_all()

    def _held(self, tensor: torch.Tensor, stable: bool) -> tuple[torch.Tensor, Optional[torch.cuda.Event], bool]:
        """What the thread writes from: a contiguous copy, or a stable tensor itself; on a device,
        the event the thread waits for first (the copy done, or the tensor final); and whether it
        was copied on the device. There a copy costs the step a fraction of a millisecond, and the
        thread streams it out through its two pinned buffers on a side stream (pinned.py), while a
        quarter of the device memory free at the first copy holds the copies not yet written. When
        that room is full the run waits for the disk to free some (_room_on_device). A copy into host
        memory (a tensor larger than the room) is page-locked anew
        (cudaHostAlloc: 8 ms a tensor, 0.5 s a GiB on the H200 host, measured) and crosses to the
        host on the step's own stream."""
        if tensor.device.type == "cpu":
            return (tensor.contiguous() if stable else tensor.clone(memory_format=torch.contiguous_format)), None, False
        on_device = not stable and self._room_on_device(tensor)
        if stable:
            held = tensor.contiguous()
        elif on_device:
            held = tensor.clone(memory_format=torch.contiguous_format)
        else:
            held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            held.copy_(tensor, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return held, ready, on_device

    def _room_on_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is copied on the device: room is taken for it, waiting for the writing
        threads to release copies where needed. A dump larger than the room was page-locked into
        host memory past it, tensor by tensor: with no bound on the host memory held, at 0.5 s a
        GiB on the step's thread (22 GiB of the 8B-wide model's fp32 dump on an H100), while the
        disk, which bounds the run either way, wrote the files behind it."""
        with self._written:
            if self._device_room is None:
                self._device_room = torch.cuda.mem_get_info(tensor.device)[0] // 4
            if tensor.nbytes > self._device_room:
                return False
        if self._on_device + tensor.nbytes > self._device_room:
            self._flush()  # the copies waiting for a file of their own are written too
        with self._written:
            self._written.wait_for(lambda: self._on_device + tensor.nbytes <= self._device_room or self._error)
            if self._error is not None:
                return False  # nothing more is written: the run goes on to raise it
            self._on_device += tensor.nbytes
            return True

    def _fill_stats(self, records: tuple[TensorRecord, ...], rows: torch.Tensor, ready: torch.cuda.Event) -> None:
        """In a writing thread: the records' statistics, read back, and their manifest entries."""
        ready.synchronize()
        # The sketches copied out of the page-locked buffer, which their views would hold for the whole run.
        for record, row, sketch in zip(records, rows[:, :SUMMARY].tolist(), rows[:, SUMMARY:].numpy().copy()):
            record.stats = TensorStats.from_summary(math.prod(record.shape), row)
            record.sketch = sketch
            self._entries[record.order] = _entry(record)


def _located(shape: tuple[int, ...], sharding: Sharding, coords: RankCoords, layout: Layout,
             bounds: Optional[tuple[int, ...]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a shard's elements lie in the whole (sketch.rows_and_cols), on its device. Worked out
    anew it cost the step's thread 18 us for a plain [64, 64] and 240 us for a CP=2 zigzag
    [2048, 2, 1024] (its runs walked in Python); cached, 1 us. Index vectors over CACHED_INDEXES
    long (a big 1-D tensor's columns) are worked out anew: a cache would hold them, on the device
    too, for the run's life."""
    small = max(math.prod(shape[:-1]), *shape[-1:], 0) <= CACHED_INDEXES
    return (_located_cached if small else _located_cached.__wrapped__)(shape, sharding, coords, layout, bounds,
                                                                         device)


@functools.lru_cache(maxsize=4096)  # asked of every record a step: the shapes and places repeat
def _located_cached(shape: tuple[int, ...], sharding: Sharding, coords: RankCoords, layout: Layout,
                    bounds: Optional[tuple[int, ...]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return rows_and_cols(*positions(shape, sharding, coords, layout, bounds), device)


def _entry(record: TensorRecord) -> str:
    """A record's manifest entry, compact JSON."""
    return json.dumps(record.to_dict(), separators=COMPACT)
