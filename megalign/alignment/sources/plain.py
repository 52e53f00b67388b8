"""Plain tensor files: a `.safetensors` or `.pt` file, or a folder of them (not recursive).

Names are the safetensors keys, the keys of a `.pt` dict (nested dicts joined with dots), or the
file stem of a `.pt` holding a single tensor. The files do not say what a tensor is (kind None):
compare.py matches them by name alone. `.pt` files are read with torch.load(weights_only=True).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from megalign.alignment.errors import UserError
from megalign.alignment.sources import Entry, Source, Value, layer_of

SUFFIXES = (".safetensors", ".pt")


def tensor_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES)


def open_plain(path: Path) -> Source:
    files = [path] if path.is_file() else tensor_files(path)
    if path.is_file() and path.suffix not in SUFFIXES:
        raise UserError(f"{path}: not a tensor file (expected .safetensors or .pt) nor a dump folder")
    entries: list[Entry] = []
    where: dict[str, Path] = {}
    for file in files:
        for name, load in _file_tensors(file):
            if name in where:
                raise UserError(f"tensor {name!r} is in both {where[name]} and {file}")
            where[name] = file
            entries.append(Entry(kind=None, name=name, order=(0, 0, len(entries)), layer=layer_of(name),
                                 load=load))
    return Source(path=path, format="tensors", description=f"tensor files: {len(files)} file(s)", entries=entries)


def _file_tensors(file: Path) -> list[tuple[str, Callable[[], Value]]]:
    if file.suffix == ".safetensors":
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = list(f.keys())
        except Exception as e:  # safetensors raises several types for a foreign or truncated file
            raise UserError(f"{file}: unreadable safetensors file ({e})") from None
        return [(key, lambda key=key: _safetensors_value(file, key)) for key in keys]
    content = load_pt(file)
    if isinstance(content, torch.Tensor):
        return [(file.stem, lambda: _pt_value(file, []))]
    if isinstance(content, dict):
        return [(".".join(map(str, path)), lambda path=path: _pt_value(file, path))
                for path in _tensor_paths(content, [])]
    raise UserError(f"{file}: holds a {type(content).__name__}, not a tensor or a dict of tensors")


def load_pt(file: Path):
    """torch.load restricted to tensors and plain containers: never unpickles arbitrary objects."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as first:
        try:  # files from torch's legacy (non-zip) serialization cannot be memory-mapped
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception:
            reason = str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__
            raise UserError(f"{file}: unreadable with torch.load(weights_only=True) ({reason})") from None


def _tensor_paths(content: dict, prefix: list) -> list[list]:
    paths = []
    for key, value in content.items():
        if isinstance(value, torch.Tensor):
            paths.append(prefix + [key])
        elif isinstance(value, dict):
            paths.extend(_tensor_paths(value, prefix + [key]))
    return paths


def _safetensors_value(file: Path, key: str) -> Value:
    try:
        with safe_open(str(file), framework="pt") as f:
            tensor = f.get_tensor(key)
    except Exception as e:
        raise UserError(f"{file}: unreadable tensor {key!r} ({e})") from None
    return tensor_value(tensor)


def _pt_value(file: Path, path: list) -> Value:
    content = load_pt(file)
    for key in path:
        content = content[key]
    return tensor_value(content)


def tensor_value(tensor: torch.Tensor) -> Value:
    tensor = tensor.detach()  # sglang's dumper saves activations that required grad as they were
    return Value(shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."), tensor=tensor)
