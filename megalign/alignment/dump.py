"""megalign's dump format: per-rank safetensors files, a manifest per rank, and dump.json.

    OUT/
      dump.json                 what ran: stack, mode, layout, model, tokens; written last by rank 0
      rank-00000/
        manifest.json           every tensor record of this rank; written last, atomically
        tensors-00000.safetensors
        tensors-00001.safetensors ...

Values live in safetensors (no pickle, memory-mappable); tensor names live only inside JSON and
safetensors keys, never in file names. A rank folder without manifest.json, or a dump without
dump.json, is incomplete and is refused by `Dump.open`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megalign.alignment.errors import UserError
from megalign.alignment.sharding import Sharding
from megalign.alignment.stats import TensorStats

FORMAT = "megalign-dump"
VERSION = 1
DUMP_META = "dump.json"
MANIFEST = "manifest.json"

Kind = Literal["input", "activation", "activation_grad", "param_grad", "logits", "logprobs", "loss"]
KINDS: tuple[str, ...] = ("input", "activation", "activation_grad", "param_grad", "logits", "logprobs", "loss")


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write to a temporary file beside `path`, then rename: readers see all of it or nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def rank_dirname(rank: int) -> str:
    return f"rank-{rank:05d}"


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp_rank: int = 0
    cp_rank: int = 0
    pp_rank: int = 0


@dataclass
class TensorRecord:
    kind: str
    name: str
    order: int
    shape: list[int]
    dtype: str
    sharding: Sharding
    module: Optional[str] = None
    layer: Optional[int] = None
    file: Optional[str] = None  # None for stats-only records
    key: Optional[str] = None
    stats: Optional[TensorStats] = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "order": self.order, "shape": self.shape,
                "dtype": self.dtype, "sharding": self.sharding.to_dict(), "module": self.module,
                "layer": self.layer, "file": self.file, "key": self.key,
                "stats": self.stats.to_dict() if self.stats else None}

    @classmethod
    def from_dict(cls, raw: dict) -> "TensorRecord":
        return cls(kind=raw["kind"], name=raw["name"], order=raw["order"], shape=list(raw["shape"]),
                   dtype=raw["dtype"], sharding=Sharding.from_dict(raw.get("sharding") or {}),
                   module=raw.get("module"), layer=raw.get("layer"), file=raw.get("file"), key=raw.get("key"),
                   stats=TensorStats.from_dict(raw["stats"]) if raw.get("stats") else None)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
            module: Optional[str] = None, layer: Optional[int] = None) -> None:
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
            self._pending[record.key] = tensor.to("cpu", copy=True).contiguous()
            self._pending_bytes += tensor.numel() * tensor.element_size()
            if self._pending_bytes >= self.flush_bytes:
                self._flush()
        self.records.append(record)

    def _current_file(self) -> str:
        return f"tensors-{self._files:05d}.safetensors"

    def _flush(self) -> None:
        if not self._pending:
            return
        save_file(self._pending, str(self.dir / self._current_file()))
        self.bytes_written += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0
        self._files += 1

    def close(self, extra: Optional[dict] = None) -> None:
        self._flush()
        write_json_atomic(self.dir / MANIFEST, {
            "format": FORMAT, "version": VERSION, "rank": self.coords.rank, "tp_rank": self.coords.tp_rank,
            "cp_rank": self.coords.cp_rank, "pp_rank": self.coords.pp_rank,
            "bytes": self.bytes_written, "tensors": [r.to_dict() for r in self.records], **(extra or {})})


@dataclass
class RankManifest:
    dir: Path
    coords: RankCoords
    records: list[TensorRecord]
    extra: dict = field(default_factory=dict)


class Dump:
    """A complete megalign dump on disk, read lazily: tensors are memory-mapped one at a time."""

    def __init__(self, path: Path, meta: dict, ranks: list[RankManifest]):
        self.path, self.meta, self.ranks = path, meta, ranks

    @staticmethod
    def is_dump(path: Path) -> bool:
        return (Path(path) / DUMP_META).is_file()

    @classmethod
    def open(cls, path: Path) -> "Dump":
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"{path}: no such dump folder")
        meta_path = path / DUMP_META
        if not meta_path.is_file():
            partial = any(path.glob("rank-*"))
            raise UserError(f"{path}: incomplete dump (no {DUMP_META}; the run that wrote it did not finish)"
                            if partial else f"{path}: not a megalign dump (no {DUMP_META})")
        meta = _read_json(meta_path)
        if meta.get("format") != FORMAT:
            raise UserError(f"{meta_path}: not a megalign dump (format {meta.get('format')!r})")
        ranks = []
        for rank in range(meta["world_size"]):
            manifest_path = path / rank_dirname(rank) / MANIFEST
            if not manifest_path.is_file():
                raise UserError(f"{path}: incomplete dump (rank {rank} has no {MANIFEST})")
            raw = _read_json(manifest_path)
            coords = RankCoords(rank=raw["rank"], tp_rank=raw["tp_rank"], cp_rank=raw["cp_rank"],
                                pp_rank=raw["pp_rank"])
            records = [TensorRecord.from_dict(r) for r in raw["tensors"]]
            extra = {k: v for k, v in raw.items() if k not in ("tensors",)}
            ranks.append(RankManifest(dir=manifest_path.parent, coords=coords, records=records, extra=extra))
        return cls(path, meta, ranks)

    def layout(self) -> dict:
        return self.meta["layout"]

    def records(self) -> Iterator[tuple[RankManifest, TensorRecord]]:
        for rank in self.ranks:
            for record in rank.records:
                yield rank, record

    def load(self, rank: RankManifest, record: TensorRecord) -> torch.Tensor:
        if record.file is None:
            raise UserError(f"{self.path}: {record.name} was dumped with --stats-only and has no values")
        file = rank.dir / record.file
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(record.key)
        except Exception as e:  # safetensors raises several types for a truncated or foreign file
            raise UserError(f"{file}: unreadable tensor file ({e})") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable ({e})") from None
