"""Writing one rank's tensors: safetensors files of about 256 MiB, then the rank's manifest.

The run waits only for each tensor's copy to host memory. A background thread hashes the copies
and writes the files, so the run goes on while the disk works; a device tensor is copied into
pinned host memory asynchronously, and the thread waits for that copy, not the run.
"""

from __future__ import annotations

import queue
import re
import threading
from pathlib import Path
from typing import Optional

import torch

from megalign.alignment.dump.format import (FORMAT, MANIFEST, VERSION, Kind, RankCoords, TensorRecord, dtype_name,
                                            rank_dirname, write_json_atomic)
from megalign.alignment.dump.sharding import Sharding
from megalign.alignment.dump.stats import TensorStats
from megalign.alignment.dump.tensorfile import content_hash, write_file

_FLUSH = object()  # queued: write the pending tensors as one file


class RankWriter:
    """Collects one rank's tensors and writes them in safetensors files of about `flush_bytes`."""

    def __init__(self, root: Path, coords: RankCoords, stats_only: bool = False,
                 name_filter: Optional[str] = None, flush_bytes: int = 256 << 20):
        self.dir = Path(root) / rank_dirname(coords.rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.coords = coords
        self.stats_only = stats_only
        self.filter = re.compile(name_filter) if name_filter else None
        self.flush_bytes = flush_bytes
        self.records: list[TensorRecord] = []
        self.bytes_written = 0  # of the files written so far: counted by the thread, read after close()
        self._queued_bytes = 0  # of the file being filled, counted as tensors are queued
        self._files = 0
        # Owned by the thread: tensors waiting for their file, and the first error it met.
        self._pending: dict[str, torch.Tensor] = {}
        self._error: Optional[BaseException] = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_queued, name="megalign-writer", daemon=True)
        self._thread.start()

    def wants(self, kind: str, name: str) -> bool:
        return kind == "input" or self.filter is None or bool(self.filter.search(name))

    def add(self, kind: Kind, name: str, tensor: torch.Tensor, sharding: Sharding,
            module: Optional[str] = None, layer: Optional[int] = None, stable: bool = False) -> None:
        """Record a tensor. `stable`: it will not change before close() (parameter gradients after the
        step), so a CPU tensor is written from where it is; any other is copied now."""
        if not self.wants(kind, name):
            return
        self._raise()
        tensor = tensor.detach()
        record = TensorRecord(kind=kind, name=name, order=len(self.records), shape=list(tensor.shape),
                              dtype=dtype_name(tensor.dtype), sharding=sharding, module=module, layer=layer)
        if self.stats_only:
            record.stats = TensorStats.of(tensor)
        else:
            record.key = str(record.order)
            record.file = f"tensors-{self._files:05d}.safetensors"
            self._queue.put((record, *_host_copy(tensor, stable)))
            self._queued_bytes += tensor.numel() * tensor.element_size()
            if self._queued_bytes >= self.flush_bytes:
                self._queue.put(_FLUSH)
                self._queued_bytes, self._files = 0, self._files + 1
        self.records.append(record)

    def close(self, extra: Optional[dict] = None) -> None:
        """Wait for every file, then write the manifest; raises what the writing thread met."""
        self._queue.put(_FLUSH)
        self._queue.put(None)
        self._thread.join()
        self._raise()
        write_json_atomic(self.dir / MANIFEST, {
            "format": FORMAT, "version": VERSION, "rank": self.coords.rank, "tp_rank": self.coords.tp_rank,
            "cp_rank": self.coords.cp_rank, "pp_rank": self.coords.pp_rank, "dp_rank": self.coords.dp_rank,
            "bytes": self.bytes_written, "tensors": [r.to_dict() for r in self.records], **(extra or {})})

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing the dump failed: {self._error}") from self._error

    def _write_queued(self) -> None:
        files = 0
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # after a failure, drain the queue without writing
            try:
                if item is _FLUSH:
                    if self._pending:
                        self.bytes_written += write_file(self.dir / f"tensors-{files:05d}.safetensors", self._pending)
                        self._pending, files = {}, files + 1
                    continue
                record, held, copied = item
                if copied is not None:
                    copied.synchronize()
                record.hash = content_hash(held)
                self._pending[record.key] = held
            except BaseException as e:  # noqa: B036 - handed to the run's thread, which raises it
                self._error = e


def _host_copy(tensor: torch.Tensor, stable: bool) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
    """A contiguous host tensor holding the values, and the event that marks its copy done (device only)."""
    if tensor.device.type == "cpu":
        return (tensor.contiguous() if stable else tensor.clone(memory_format=torch.contiguous_format)), None
    held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    held.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return held, copied
