"""Plain tensor files: a `.safetensors` or `.pt` file, or a folder of them (not recursive).

Names are the safetensors keys, the keys of a `.pt` dict (nested dicts joined with dots), or the
file stem of a `.pt` holding a single tensor. The files do not say what a tensor is (kind None):
compare.py matches them by name alone. `.pt` files are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from megalign.compare.entries import Entry, Source, Value
from megalign.dump.format import layer_of
from megalign.errors import UserError

SUFFIXES = (".safetensors", ".pt")


def tensor_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and is_regular(p))


def is_regular(path: Path) -> bool:
    """A regular file, not a link: files found in a folder are read only when they are its own."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about pickle protocols before it refuses a file
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            pass
        try:  # files from torch's legacy (non-zip) serialization cannot be memory-mapped
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            raise UserError(f"{file}: refused: torch.load(weights_only=True) reads tensors only, and this file "
                            f"holds something else ({_refusal(error)})") from None


def _refusal(error: Exception) -> str:
    """torch's reason in a few words, without its advice to load the file with weights_only=False."""
    text = str(error)
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("WeightsUnpickler error:", "Unsupported global", "Unsupported operand")):
            return line.removeprefix("WeightsUnpickler error:").strip().split(". ")[0]
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return first if "weights_only" not in first else "not a file of tensors only"


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
