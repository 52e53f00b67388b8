"""Reading tensors out of a dump's safetensors files by offset, each file's header parsed once.

Written by hand, not through safetensors' safe_open, for speed and memory: safe_open parses a file's
whole header on every open (10 ms for a file of 800 tensors, measured: most of a comparison's time
on a real dump), and a handle kept open would keep every page read mapped for the whole comparison.
The format is an 8-byte little-endian length, a JSON header and the raw data, so a tensor is one
positioned read into memory that is freed with the tensor. Every header value is checked against
the file before it is used: a dump may come from anywhere.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from megalign.alignment.errors import UserError

# safetensors' dtype names, the ones torch reads.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class _Unreadable(Exception):
    pass


class TensorFiles:
    """Headers of the files read so far, keyed by path, size and modification time (a file that
    changes is read anew). Safe to share between threads."""

    def __init__(self):
        self._headers: dict[tuple, tuple[int, dict]] = {}
        self._lock = threading.Lock()

    def load(self, path: Path, key: str) -> torch.Tensor:
        try:
            with open(path, "rb") as f:
                status = os.fstat(f.fileno())
                data_start, header = self._header(f, (str(path), status.st_size, status.st_mtime_ns))
                dtype, shape, begin, end = _entry(header, key, status.st_size - data_start)
                buffer = bytearray(end - begin)
                if end > begin and os.preadv(f.fileno(), [buffer], data_start + begin) != end - begin:
                    raise _Unreadable("the file ends inside the tensor")
        except (OSError, _Unreadable) as e:
            raise UserError(f"{path}: unreadable tensor file ({e})") from None
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)

    def _header(self, f, cache_key: tuple) -> tuple[int, dict]:
        with self._lock:
            known = self._headers.get(cache_key)
        if known is not None:
            return known
        raw = f.read(8)
        if len(raw) != 8:
            raise _Unreadable("no header")
        length = int.from_bytes(raw, "little")
        if not 2 <= length <= min(MAX_HEADER, cache_key[1] - 8):
            raise _Unreadable(f"header length {length}")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _Unreadable(f"header: {type(e).__name__}") from None
        if not isinstance(header, dict):
            raise _Unreadable("header is not a JSON object")
        parsed = (8 + length, header)
        with self._lock:
            self._headers[cache_key] = parsed
        return parsed


def _entry(header: dict, key: str, data_size: int) -> tuple[torch.dtype, list[int], int, int]:
    """A key's dtype, shape and data offsets, each checked: the offsets must hold exactly the tensor."""
    entry = header.get(key) if key != "__metadata__" else None
    if not isinstance(entry, dict):
        raise _Unreadable(f"no tensor {key!r}")
    name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise _Unreadable(f"tensor {key!r}: dtype {entry.get('dtype')!r}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise _Unreadable(f"tensor {key!r}: shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) and not isinstance(n, bool)
                                                                    for n in offsets)):
        raise _Unreadable(f"tensor {key!r}: data_offsets {offsets!r}")
    begin, end = offsets
    numel = 1
    for n in shape:
        numel *= n
    if not 0 <= begin <= end <= data_size or end - begin != numel * dtype.itemsize:
        raise _Unreadable(f"tensor {key!r}: data_offsets {offsets} do not hold {shape} of {name}")
    return dtype, shape, begin, end
