"""Checking the JSON of a dump before anything is read from it: a dump may come from anywhere.

Every field the reader uses is checked for its type and range, and every tensor file a record names
must be a plain file name inside its rank folder. A malformed dump is one `UserError` naming the file
and the field (exit 2), never a traceback, a hang, or a file read outside the dump.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megalign.dump.format import FORMAT, KINDS, PRECISIONS, VERSIONS, RankCoords, TensorRecord, check_name
from megalign.dump.layout import CP_SPLITS, BatchRow, Layout, cp_split_bounds
from megalign.dump.sharding import MeshPlacement, Sharding
from megalign.dump.sketch import K, decode, finite
from megalign.dump.stats import TensorStats
from megalign.dump.tensorfile import STORED_DTYPES
from megalign.errors import UserError, is_int, is_number

LAYOUT_AXES = ("tp", "pp", "cp")  # every dump has them; dp came later, 1 when absent


class Malformed(UserError):
    pass


def _int(value: Any, where: str, low: int = 0) -> int:
    if not is_int(value) or value < low:
        raise Malformed(f"{where} must be an integer >= {low}, got {value!r}")
    return value


def _optional_int(value: Any, where: str) -> Optional[int]:
    return None if value is None else _int(value, where)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise Malformed(f"{where} must be a non-empty string, got {value!r}")
    return value


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise Malformed(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def check_meta(raw: Any, where: str) -> tuple[dict, Layout]:
    """dump.json, and its layout typed: its format, version and layout are checked; the rest is description."""
    meta = _dict(raw, where)
    if meta.get("format") != FORMAT:
        raise Malformed(f"{where}: not a megalign dump (format {meta.get('format')!r})")
    if meta.get("version") not in VERSIONS:
        raise Malformed(f"{where}: dump format version {meta.get('version')!r} is not supported "
                        f"(this megalign reads versions {', '.join(map(str, VERSIONS))})")
    if meta.get("dtype") not in PRECISIONS:  # thresholds follow it: a missing one would loosen nothing safely
        raise Malformed(f"{where}: dtype {meta.get('dtype')!r} is not one of {', '.join(PRECISIONS)}")
    layout = check_layout(meta.get("layout"), f"{where}: layout")
    if meta.get("world_size") != layout.world_size:
        raise Malformed(f"{where}: world_size {meta.get('world_size')!r} is not the product of the layout "
                        f"({layout.world_size})")
    return meta, layout


def check_layout(raw: Any, where: str) -> Layout:
    """dump.json's layout, typed: tp, pp and cp, which every dump has; dp (1 when absent: it came
    later), sp, ep and etp. Keys it does not know are left alone."""
    raw = _dict(raw, where)
    sizes = {axis: _int(raw.get(axis), f"{where}.{axis}", low=1) for axis in LAYOUT_AXES}
    sizes["dp"] = _int(raw.setdefault("dp", 1), f"{where}.dp", low=1)
    if not isinstance(raw.setdefault("sp", False), bool):
        raise Malformed(f"{where}.sp must be true or false")
    etp = raw.get("etp")
    return Layout(**sizes, sp=raw["sp"], ep=_int(raw.get("ep", 1), f"{where}.ep", low=1),
                  etp=None if etp is None else _int(etp, f"{where}.etp", low=1))


def check_rows(meta: dict, layout: Layout, where: str) -> tuple[Optional[list[BatchRow]], dict]:
    """dump.json's `rows` (optional: dumps of other tools lack them): the batch's documents, which the
    CP split of a packed row follows and which line a packed run up with a padded one; and its
    `step_rows`, each dumped step's where they differ from step to step ({step: rows}; a Dumper's)."""
    if meta.get("rows_unknown") is not None and not isinstance(meta["rows_unknown"], str):
        raise Malformed(f"{where}: rows_unknown must be a string (why the rows were not recorded)")
    if meta.get("rows") is None and meta.get("step_rows") is None:
        return None, {}
    if meta.setdefault("cp_split", "document") not in CP_SPLITS:
        raise Malformed(f"{where}: cp_split must be document or row, got {meta['cp_split']!r}")
    rows = None if meta.get("rows") is None else _rows(meta, layout, where)
    by_step = {}
    raw_steps = meta.get("step_rows")
    if raw_steps is not None:
        if not isinstance(raw_steps, list) or rows is not None:
            raise Malformed(f"{where}: step_rows must be a list, in a dump without rows")
        for i, raw in enumerate(raw_steps):
            step = _dict(raw, f"{where}: step_rows[{i}]")
            if step.get("step") is not None:
                _int(step["step"], f"{where}: step_rows[{i}].step")
            by_step[step.get("step")] = _rows({**step, "cp_split": meta["cp_split"]}, layout,
                                              f"{where}: step_rows[{i}]")
    return rows, by_step


def _rows(meta: dict, layout: Layout, where: str) -> list[BatchRow]:
    raw_rows = meta["rows"]
    if not isinstance(raw_rows, list) or not raw_rows or len(raw_rows) % layout.dp:
        raise Malformed(f"{where}: rows must be a non-empty list, a multiple of layout.dp long")
    rows = []
    for i, raw in enumerate(raw_rows):
        row = _dict(raw, f"{where}: rows[{i}]")
        bounds, lengths = row.get("bounds"), row.get("lengths")
        if not isinstance(bounds, list) or not isinstance(lengths, list) or len(lengths) != len(bounds) - 1 \
                or not lengths:
            raise Malformed(f"{where}: rows[{i}] must have bounds and lengths, one length per document")
        bounds = [_int(b, f"{where}: rows[{i}].bounds") for b in bounds]
        lengths = [_int(n, f"{where}: rows[{i}].lengths") for n in lengths]
        sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        if bounds[0] != 0 or min(sizes) <= 0 or any(n > size for n, size in zip(lengths, sizes)):
            raise Malformed(f"{where}: rows[{i}]: bounds must rise from 0 and each document fit its bounds")
        rows.append(BatchRow(bounds=tuple(bounds), lengths=tuple(lengths)))
    if len({row.bounds[-1] for row in rows}) != 1:
        raise Malformed(f"{where}: rows have different lengths")
    documents = sum(len(row.lengths) for row in rows)
    if documents != meta.get("num_sequences") or len(rows) not in (documents, layout.dp):
        raise Malformed(f"{where}: rows hold {documents} documents in {len(rows)} rows, for num_sequences "
                        f"{meta.get('num_sequences')!r} (one a row, or packed one row a DP rank)")
    if layout.cp > 1 and any(size % (2 * layout.cp) for row in rows for size in _sizes(row, meta["cp_split"])):
        raise Malformed(f"{where}: rows: a document (or row) is not a multiple of 2*cp={2 * layout.cp} long")
    return rows


def _sizes(row: BatchRow, cp_split: str) -> list[int]:
    bounds = cp_split_bounds(row, cp_split)
    return [end - start for start, end in zip(bounds[:-1], bounds[1:])]


def check_manifest(raw: Any, where: str, rank: int, layout: Layout, rank_dir: Path) -> tuple[RankCoords, list, dict]:
    manifest = _dict(raw, where)
    if manifest.get("format") != FORMAT or manifest.get("version") not in VERSIONS:
        raise Malformed(f"{where}: not a megalign manifest of versions {', '.join(map(str, VERSIONS))}")
    if manifest.get("rank") != rank:
        raise Malformed(f"{where}: rank {manifest.get('rank')!r} in the folder of rank {rank}")
    coords = RankCoords(rank=rank, **{f"{axis}_rank": _int(manifest.get(f"{axis}_rank", 0), f"{where}: {axis}_rank")
                                      for axis in LAYOUT_AXES + ("dp",)})
    for axis in LAYOUT_AXES + ("dp",):
        if getattr(coords, f"{axis}_rank") >= getattr(layout, axis):
            raise Malformed(f"{where}: {axis}_rank {getattr(coords, f'{axis}_rank')} is outside the layout's "
                            f"{axis}={getattr(layout, axis)}")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, list):
        raise Malformed(f"{where}: tensors must be a list of records")
    records = [check_record(r, f"{where}: tensors[{i}]", rank_dir) for i, r in enumerate(tensors)]
    _no_duplicates(records, where)
    extra = {k: v for k, v in manifest.items() if k != "tensors"}
    return coords, records, extra


def check_record(raw: Any, where: str, rank_dir: Path) -> TensorRecord:
    record = _dict(raw, where)
    kind = record.get("kind")
    if kind not in KINDS:
        raise Malformed(f"{where}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    shape = record.get("shape")
    if not isinstance(shape, list):
        raise Malformed(f"{where}: shape must be a list of integers")
    dtype = record.get("dtype")
    if not isinstance(dtype, str) or dtype not in STORED_DTYPES:  # a list is unhashable: a dict lookup would raise
        raise Malformed(f"{where}: unknown dtype {dtype!r}")
    file, key, stats = record.get("file"), record.get("key"), record.get("stats")
    if file is None and stats is None:
        raise Malformed(f"{where}: a record needs a file (values) or stats (--stats-only)")
    shape = [_int(n, f"{where}: shape") for n in shape]
    if file is not None:
        # Its bytes must fit in its file: a shape claiming more would be allocated before any read.
        check_tensor_file(_str(file, f"{where}: file"), rank_dir, where, holds=math.prod(shape) * STORED_DTYPES[dtype].itemsize)
        _str(key, f"{where}: key")
    return TensorRecord(kind=kind, name=_name(record.get("name"), f"{where}: name"),
                        order=_int(record.get("order"), f"{where}: order"),
                        shape=shape, dtype=dtype,
                        sharding=_sharding(record.get("sharding"), shape, where),
                        module=record.get("module") if isinstance(record.get("module"), str) else None,
                        layer=record.get("layer") if isinstance(record.get("layer"), int) else None,
                        file=file, key=key, stats=None if stats is None else _stats(stats, where),
                        hash=_hash(record.get("hash"), where),
                        call=_optional_int(record.get("call"), f"{where}: call"),
                        sketch=_sketch(record.get("sketch"), stats, where))


def _sketch(raw: Any, stats: Any, where: str) -> Optional[np.ndarray]:
    """A stats-only record's sketch: K float64 values in base64 (sketch.encode); one that overflowed
    (sketch.finite) reads as none."""
    if raw is None:
        return None
    values = decode(raw) if isinstance(raw, str) and stats is not None else None
    if values is None:
        raise Malformed(f"{where}: sketch must be {K} float64 values in base64, beside stats")
    return finite(values)


def _name(raw: Any, where: str) -> str:
    """A tensor's name; one that reads as a repeat (written before writers refused it) is ambiguous."""
    name = _str(raw, where)
    if reason := check_name(name):
        raise Malformed(f"{where}: {reason}")
    return name


def _hash(raw: Any, where: str) -> Optional[str]:
    if raw is None:
        return None
    if not (isinstance(raw, str) and len(raw) == 32 and all(c in "0123456789abcdef" for c in raw)):
        raise Malformed(f"{where}: hash must be 32 lowercase hex digits")
    return raw


def check_tensor_file(name: str, rank_dir: Path, where: str, holds: int = 0) -> Path:
    """A record's file: a plain name of a regular file in its rank folder (no path, no link, no FIFO),
    of at least `holds` bytes."""
    if Path(name).name != name or name in (".", "..") or "/" in name or "\\" in name:
        raise Malformed(f"{where}: file {name!r} is not a file name inside the rank folder")
    path = rank_dir / name
    try:
        info = os.lstat(path)
    except OSError:
        raise Malformed(f"{where}: file {name!r} is missing from {rank_dir}") from None
    if not stat.S_ISREG(info.st_mode):
        raise Malformed(f"{where}: {path} is not a regular file")
    if holds > info.st_size:
        raise Malformed(f"{where}: {path} is unreadable: the shape needs {holds} bytes, more than the file holds "
                        f"({info.st_size})")
    return path


def _sharding(raw: Any, shape: list[int], where: str) -> Sharding:
    raw = _dict(raw if raw is not None else {}, f"{where}: sharding")
    ndim = len(shape)
    sp = raw.get("sp", False)
    if not isinstance(sp, bool):
        raise Malformed(f"{where}: sharding.sp must be true or false")
    sharding = Sharding(seq_dim=_optional_int(raw.get("seq_dim"), f"{where}: sharding.seq_dim"),
                        tp_dim=_optional_int(raw.get("tp_dim"), f"{where}: sharding.tp_dim"),
                        tp_parts=_int(raw.get("tp_parts", 1), f"{where}: sharding.tp_parts", low=1), sp=sp,
                        dp_dim=_optional_int(raw.get("dp_dim"), f"{where}: sharding.dp_dim"),
                        mesh=None if raw.get("mesh") is None else _mesh(raw["mesh"], shape, f"{where}: sharding.mesh"))
    if sharding.mesh is not None and (sharding.seq_dim, sharding.tp_dim, sharding.dp_dim, sharding.sp) != \
            (None, None, None, False):
        raise Malformed(f"{where}: sharding.mesh places the tensor alone: seq_dim, tp_dim, dp_dim and sp must be unset")
    if sharding.sp and (sharding.seq_dim is None or sharding.tp_dim is not None):
        raise Malformed(f"{where}: sharding.sp needs a seq_dim and no tp_dim")
    for dim in (sharding.seq_dim, sharding.tp_dim, sharding.dp_dim):
        if dim is not None and dim >= ndim:
            raise Malformed(f"{where}: sharding names dim {dim} of a {ndim}-dim tensor")
    return sharding


def _ints(raw: Any, where: str, length: int, low: int = 0) -> tuple[int, ...]:
    if not isinstance(raw, list) or len(raw) != length:
        raise Malformed(f"{where} must be a list of {length} integers")
    return tuple(_int(n, where, low) for n in raw)


def _mesh(raw: Any, shape: list[int], where: str) -> MeshPlacement:
    """A DTensor's piece: the mesh, this rank's coordinate on it, one placement a mesh dim (S<d>, R,
    P), the whole shape and the piece's offset, which must hold the piece. A tensor dim that no
    placement splits is the whole's."""
    raw = _dict(raw, where)
    if not isinstance(raw.get("shape"), list) or not raw["shape"]:
        raise Malformed(f"{where}.shape must be a non-empty list of integers")
    mesh = _ints(raw["shape"], f"{where}.shape", len(raw["shape"]), low=1)
    coord = _ints(raw.get("coord"), f"{where}.coord", len(mesh))
    if any(c >= n for c, n in zip(coord, mesh)):
        raise Malformed(f"{where}.coord {list(coord)} is outside the mesh {list(mesh)}")
    placements = raw.get("placements")
    split = {f"S{d}": d for d in range(len(shape))}
    if not isinstance(placements, list) or len(placements) != len(mesh) \
            or not all(isinstance(p, str) and (p in ("R", "P") or p in split) for p in placements):
        raise Malformed(f"{where}.placements must be one of R, P or S<dim> (dim < {len(shape)}) a mesh dim")
    whole = _ints(raw.get("global_shape"), f"{where}.global_shape", len(shape))
    offset = _ints(raw.get("offset"), f"{where}.offset", len(shape))
    sharded = {split[p] for p in placements if p in split}
    for d, (size, start, total) in enumerate(zip(shape, offset, whole)):
        if start + size > total or (d not in sharded and (start, size) != (0, total)):
            raise Malformed(f"{where}: the piece {shape} at offset {list(offset)} does not lie in "
                            f"{list(whole)} on mesh {list(mesh)} at {list(coord)}")
    return MeshPlacement(shape=mesh, coord=coord, placements=tuple(placements), whole=whole, offset=offset)


def _stats(raw: Any, where: str) -> TensorStats:
    raw = _dict(raw, f"{where}: stats")
    fields = TensorStats.__dataclass_fields__
    if set(raw) != set(fields) or not all(map(is_number, raw.values())):
        raise Malformed(f"{where}: stats must hold the numbers {', '.join(fields)}")
    return TensorStats.from_dict(raw)


def _no_duplicates(records: list[TensorRecord], where: str) -> None:
    orders, keys = set(), set()
    for record in records:
        if record.order in orders or (record.file and (record.file, record.key) in keys):
            raise Malformed(f"{where}: duplicate record {record.kind} {record.name} (order {record.order})")
        orders.add(record.order)
        keys.add((record.file, record.key))
