"""A dump's safetensors files, written and read by hand: whole files out, tensors in by offset.

Not through the safetensors package, for speed and memory. Its save_file turns every tensor into a
bytes object first (copies the run waits for); here each tensor's memory goes to the file as it is.
Its safe_open parses a file's whole header on every open (10 ms for a file of 800 tensors, measured:
most of a comparison's time on a real dump), and a handle kept open would keep every page read
mapped for the whole comparison; here a header is parsed once per file and a tensor is one
positioned read into memory the caller owns. The format is an 8-byte little-endian length, a JSON
header (padded to 8 bytes) and the tensors' bytes back to back, so the files stay readable by the
safetensors package. Every header value is checked against the file before it is used: a dump may
come from anywhere.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import xxhash

from megalign.dump.format import dtype_name
from megalign.errors import UserError, is_int

# safetensors' dtype names, the ones torch reads.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# What a dump holds, as a refusal says it.
STORED = f"dense tensors of {', '.join(dtype_name(dtype) for dtype in DTYPES.values())}, with values"
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


def unstorable(tensor: torch.Tensor) -> Optional[str]:
    """What keeps a dump from holding `tensor` ("a complex64 tensor"), or None. Checked where a tensor is
    added: a dtype safetensors has no name for failed the whole dump at close, after the run."""
    if tensor.is_nested:
        return "a nested tensor"
    if tensor.layout != torch.strided:
        return f"a tensor of layout {tensor.layout}"
    if tensor.is_meta:
        return "a tensor on the meta device"
    if tensor.dtype not in NAMES:
        return f"a {dtype_name(tensor.dtype)} tensor"
    return None


def content_hash(tensor: torch.Tensor) -> str:
    """xxh3_128 of a contiguous CPU tensor's bytes (10 GB/s on one core here, measured: sha256 ran at
    1.4 GB/s, which a dump of tens of GB would wait for)."""
    return xxhash.xxh3_128_hexdigest(tensor_bytes(tensor))


def tensor_bytes(tensor: torch.Tensor):
    """A contiguous CPU tensor's own memory, as bytes."""
    return tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""


def write_file(path: Path, tensors: dict[str, torch.Tensor],
               pieces: Optional[Callable] = None) -> tuple[int, dict[str, str]]:
    """Write contiguous tensors as one safetensors file, each from the byte pieces `pieces(tensor)`
    yields (default: a CPU tensor's own memory). Returns the bytes of tensor data and each key's
    content hash, taken from the bytes as they were written."""
    header, offset = {}, 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    pieces, hashes = pieces or _whole, {}
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for key, tensor in tensors.items():
            digest = xxhash.xxh3_128()  # streamed, it gives content_hash's value
            for piece in pieces(tensor):
                digest.update(piece)
                f.write(piece)
            hashes[key] = digest.hexdigest()
    return offset, hashes


def _whole(tensor: torch.Tensor) -> tuple:
    return (tensor_bytes(tensor),)


class _Unreadable(Exception):
    pass


@dataclass(frozen=True)
class Location:
    """A tensor in a file: its dtype and shape, and the file offset of its first byte."""

    path: Path
    dtype: torch.dtype
    shape: list[int]
    offset: int


def read_into(location: Location, out: torch.Tensor, start: int = 0) -> None:
    """Fill the contiguous tensor `out` with the tensor's bytes from byte `start` on: a positioned
    read straight into `out`'s memory, with no copy and no zero-filling."""
    size = out.numel() * out.element_size()
    if size == 0:
        return
    target = out.view(-1).view(torch.uint8).numpy()  # a writable view of out's memory, any dtype
    done = 0
    try:
        # The file was checked when located; it may have been swapped since: no link, no waiting on a FIFO.
        fd = os.open(location.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            while done < size:  # one read returns at most 2 GiB on Linux
                got = os.preadv(fd, [target[done:]], location.offset + start + done)
                if got == 0:
                    raise UserError(f"{location.path}: unreadable tensor file (the file ends inside the tensor)")
                done += got
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(f"{location.path}: unreadable tensor file ({e})") from None


class TensorFiles:
    """Headers of the files read so far, each parsed once. Safe to share between threads. A file
    that changes afterwards is not parsed again; one that shrinks fails its reads (read_into)."""

    def __init__(self):
        self._headers: dict[Path, tuple[int, dict, int]] = {}  # path -> (data start, header, file size)
        self._lock = threading.Lock()

    def locate(self, path: Path, key: str) -> Location:
        """Where a key's tensor lies, every header value checked against the file."""
        try:
            with self._lock:
                known = self._headers.get(path)
            data_start, header, size = known if known is not None else self._parse(path)
            dtype, shape, begin, _ = _entry(header, key, size - data_start)
        except (OSError, _Unreadable) as e:
            raise UserError(f"{path}: unreadable tensor file ({e})") from None
        return Location(path, dtype, shape, data_start + begin)

    def _parse(self, path: Path) -> tuple[int, dict, int]:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise _Unreadable("no header")
            length = int.from_bytes(raw, "little")
            if not 2 <= length <= min(MAX_HEADER, size - 8):
                raise _Unreadable(f"header length {length}")
            try:
                header = json.loads(f.read(length).decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise _Unreadable(f"header: {type(e).__name__}") from None
        if not isinstance(header, dict):
            raise _Unreadable("header is not a JSON object")
        parsed = (8 + length, header, size)
        with self._lock:
            self._headers[path] = parsed
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
    if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
        raise _Unreadable(f"tensor {key!r}: shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets))):
        raise _Unreadable(f"tensor {key!r}: data_offsets {offsets!r}")
    begin, end = offsets
    numel = 1
    for n in shape:
        numel *= n
    if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
        raise _Unreadable(f"tensor {key!r}: data_offsets {offsets} do not hold {shape} of {name}")
    if end > data_size:
        raise _Unreadable(f"tensor {key!r}: data_offsets {offsets} end past the file's {data_size} bytes of data "
                          "(the file is cut short)")
    return dtype, shape, begin, end
