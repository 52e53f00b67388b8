"""Reading a complete megalign dump: dump.json, every rank's manifest, and tensors, each read on demand."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from megalign.dump.format import DUMP_META, MANIFEST, RankCoords, TensorRecord, dtype_name, rank_dirname
from megalign.dump.layout import BatchRow, Layout, cp_split_bounds, dp_rows
from megalign.dump.tensorfile import Location, TensorFiles, read_into
from megalign.dump.validate import check_manifest, check_meta, check_rows, check_tensor_file
from megalign.errors import UserError


@dataclass
class RankManifest:
    dir: Path
    coords: RankCoords
    records: list[TensorRecord]
    extra: dict = field(default_factory=dict)


class DumpFiles:
    """A complete megalign dump on disk, read lazily: a tensor is read when it is loaded."""

    def __init__(self, path: Path, meta: dict, layout: Layout, ranks: list[RankManifest],
                 rows: Optional[list[BatchRow]] = None, step_rows: Optional[dict] = None):
        self.path, self.meta, self.layout, self.ranks, self.rows = path, meta, layout, ranks, rows
        # Each dumped step's rows where they differ from step to step (dump.json's step_rows).
        self.step_rows: dict[Optional[int], list[BatchRow]] = step_rows or {}
        self.files = TensorFiles()
        self._located: dict[tuple, Location] = {}
        self._checked: dict[tuple, Path] = {}  # (rank folder, file name) -> the checked file

    @staticmethod
    def is_dump(path: Path) -> bool:
        return (Path(path) / DUMP_META).is_file()

    @classmethod
    def open(cls, path: Path) -> "DumpFiles":
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"{path}: no such dump folder")
        meta_path = path / DUMP_META
        if not meta_path.is_file():
            partial = any(path.glob("rank-*"))
            raise UserError(f"{path}: incomplete dump (no {DUMP_META}; the run that wrote it did not finish)"
                            if partial else f"{path}: not a megalign dump (no {DUMP_META})")
        meta, layout = check_meta(_read_json(meta_path), str(meta_path))
        rows, step_rows = check_rows(meta, layout, str(meta_path))
        ranks = []
        for rank in range(meta["world_size"]):
            manifest_path = _rank_dir(path, rank) / MANIFEST
            if not manifest_path.is_file():
                raise UserError(f"{path}: incomplete dump (rank {rank} has no {MANIFEST})")
            coords, records, extra = check_manifest(_read_json(manifest_path), str(manifest_path), rank,
                                                    layout, manifest_path.parent)
            ranks.append(RankManifest(dir=manifest_path.parent, coords=coords, records=records, extra=extra))
        dump = cls(path, meta, layout, ranks, rows, step_rows)
        dump._locate_all()
        return dump

    def rows_at(self, step: Optional[int]) -> Optional[list[BatchRow]]:
        """The rows of the batch the records of `step` (None: of a dump that names no steps) were made from."""
        if not self.step_rows:
            return self.rows
        if step is None and len(self.step_rows) == 1:
            return next(iter(self.step_rows.values()))
        return self.step_rows.get(step)

    def cp_bounds(self, dp_rank: int) -> Optional[tuple[int, ...]]:
        """Where a DP rank's row was cut for the CP split: at its documents (packed rows split per
        document), or None (the whole row is one sequence)."""
        if self.rows is None:
            return None
        row = self.rows[dp_rows(len(self.rows), self.layout.dp, dp_rank)][0]
        bounds = cp_split_bounds(row, self.meta.get("cp_split"))
        return bounds if len(bounds) > 2 else None

    def records(self) -> Iterator[tuple[RankManifest, TensorRecord]]:
        for rank in self.ranks:
            for record in rank.records:
                yield rank, record

    def locate(self, rank: RankManifest, record: TensorRecord) -> Location:
        """Where a record's tensor lies, checked to hold what the manifest says (once per record)."""
        key = (rank.coords.rank, record.file, record.key)
        location = self._located.get(key)
        if location is None:
            location = self._located[key] = self._locate(rank, record)
        return location

    def _locate_all(self) -> None:
        """Every record's bytes checked to lie in its file now, whether or not they are read later: a
        replica whose hash equals the first copy's is never read (compare/plan.py), and a file cut short
        inside it would pass."""
        for rank, record in self.records():
            if record.file is not None:
                self.locate(rank, record)

    def _locate(self, rank: RankManifest, record: TensorRecord) -> Location:
        if record.file is None:
            raise UserError(f"{self.path}: {record.name} was dumped with --stats-only and has no values")
        file = self._checked.get((rank.dir, record.file))
        if file is None:
            file = self._checked[(rank.dir, record.file)] = check_tensor_file(record.file, rank.dir,
                                                                              f"{self.path}: {record.name}")
        location = self.files.locate(file, record.key)
        if location.shape != record.shape or dtype_name(location.dtype) != record.dtype:
            raise UserError(f"{file}: key {record.key!r} holds {dtype_name(location.dtype)} {location.shape}, but "
                            f"the manifest's record {record.kind} {record.name} says {record.dtype} {record.shape}")
        return location

    def load(self, rank: RankManifest, record: TensorRecord) -> torch.Tensor:
        location = self.locate(rank, record)
        tensor = torch.empty(location.shape, dtype=location.dtype)
        read_into(location, tensor)
        return tensor


def _rank_dir(path: Path, rank: int) -> Path:
    """A rank's folder: a link to one inside the dump is followed, one out of it (into another dump) refused."""
    rank_dir = path / rank_dirname(rank)
    try:
        target = rank_dir.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a loop of links (Python < 3.13)
        raise UserError(f"{rank_dir}: unreadable ({e})") from None
    if not target.is_relative_to(path.resolve()):
        raise UserError(f"{rank_dir}: a link out of the dump (to {target}); a rank folder must lie inside it")
    return rank_dir


def _read_json(path: Path):
    """A dump's JSON file: a regular file (a link could lead outside the dump, a FIFO would hang)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise UserError(f"{path}: not a regular file")
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
