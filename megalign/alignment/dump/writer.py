"""Writing one rank's tensors: safetensors files of about 256 MiB, then the rank's manifest."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch

from megalign.alignment.dump.format import (FORMAT, MANIFEST, VERSION, Kind, RankCoords, TensorRecord, dtype_name,
                                            rank_dirname, write_json_atomic)
from megalign.alignment.dump.sharding import Sharding
from megalign.alignment.dump.stats import TensorStats
from megalign.alignment.dump.tensorfile import content_hash, write_file


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
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files = 0
        self.bytes_written = 0

    def wants(self, kind: str, name: str) -> bool:
        return kind == "input" or self.filter is None or bool(self.filter.search(name))

    def add(self, kind: Kind, name: str, tensor: torch.Tensor, sharding: Sharding,
            module: Optional[str] = None, layer: Optional[int] = None, stable: bool = False) -> None:
        """Record a tensor. `stable`: it will not change before close() (parameter gradients after the
        step), so a CPU tensor is written from where it is; any other is copied now."""
        if not self.wants(kind, name):
            return
        tensor = tensor.detach()
        record = TensorRecord(kind=kind, name=name, order=len(self.records), shape=list(tensor.shape),
                              dtype=dtype_name(tensor.dtype), sharding=sharding, module=module, layer=layer)
        if self.stats_only:
            record.stats = TensorStats.of(tensor)
        else:
            record.key = str(record.order)
            record.file = self._current_file()
            held = tensor.contiguous() if stable and tensor.device.type == "cpu" else \
                tensor.to("cpu", copy=True).contiguous()
            self._pending[record.key] = held
            record.hash = content_hash(held)
            self._pending_bytes += tensor.numel() * tensor.element_size()
            if self._pending_bytes >= self.flush_bytes:
                self._flush()
        self.records.append(record)

    def _current_file(self) -> str:
        return f"tensors-{self._files:05d}.safetensors"

    def _flush(self) -> None:
        if not self._pending:
            return
        self.bytes_written += write_file(self.dir / self._current_file(), self._pending)
        self._pending, self._pending_bytes = {}, 0
        self._files += 1

    def close(self, extra: Optional[dict] = None) -> None:
        self._flush()
        write_json_atomic(self.dir / MANIFEST, {
            "format": FORMAT, "version": VERSION, "rank": self.coords.rank, "tp_rank": self.coords.tp_rank,
            "cp_rank": self.coords.cp_rank, "pp_rank": self.coords.pp_rank, "dp_rank": self.coords.dp_rank,
            "bytes": self.bytes_written, "tensors": [r.to_dict() for r in self.records], **(extra or {})})
