"""The three kinds of input `megalign compare` reads, behind one interface.

A `Source` is a list of `Entry`s, one per logical tensor, each with a loader that returns the
whole tensor (reassembled from its rank shards where the format says how) as a `Value`. Nothing is
loaded until a loader is called, so a comparison holds only the tensors it is working on.

    megalign dump   a folder with dump.json and rank-*/manifest.json        (sources/megalign.py)
    sglang dump     `.pt` files written by sglang's dumper, one per tensor   (sources/sglang.py)
    plain tensors   a `.safetensors` / `.pt` file or a folder of them        (sources/plain.py)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from megalign.alignment.errors import UserError
from megalign.alignment.stats import TensorStats

# Execution order: forward tensors, then activation gradients (in backward order), then the
# parameter gradients that the optimizer step would see.
PHASES = {"input": 0, "activation": 0, "logits": 0, "logprobs": 0, "loss": 0, "param": 0,
          "activation_grad": 1, "param_grad": 2}
_LAYER = re.compile(r"layers\.(\d+)(?:\.|$)")


@dataclass
class Value:
    """A loaded tensor: its values, or only its statistics (--stats-only dumps), or why neither."""

    shape: list[int]
    dtype: str
    tensor: Optional[torch.Tensor] = None
    stats: Optional[TensorStats] = None
    replica_diff: Optional[float] = None  # max abs disagreement between copies that should be equal
    problem: Optional[str] = None  # set when the shards cannot be put back together


@dataclass
class Entry:
    kind: Optional[str]  # None for plain tensor files, which do not say what a tensor is
    name: str
    order: tuple  # sorts entries of one source in execution order
    layer: Optional[int]
    load: Callable[[], Value]
    # Where the format records them: an only-in-one-side row then needs no load at all.
    shape: Optional[list[int]] = None
    dtype: Optional[str] = None


@dataclass
class Source:
    path: Path
    format: str  # megalign | sglang | tensors
    description: str
    entries: list[Entry]
    precision: Optional[str] = None  # the run's dtype where the format records it


def phase(kind: Optional[str]) -> int:
    return PHASES.get(kind or "activation", 0)


def layer_of(name: str) -> Optional[int]:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def open_source(path: Path) -> Source:
    """Detect what `path` is and open it; UserError (exit 2) when it is none of the three."""
    from megalign.alignment.dump import Dump
    from megalign.alignment.sources import megalign, plain, sglang

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if path.is_file():
        return plain.open_plain(path)
    if Dump.is_dump(path) or any(path.glob("rank-*")):
        return megalign.open_megalign(path)
    sglang_dir = sglang.find_sglang_dir(path)
    if sglang_dir is not None:
        return sglang.open_sglang(path, sglang_dir)
    if plain.tensor_files(path):
        return plain.open_plain(path)
    raise UserError(f"{path}: not a megalign dump, an sglang dump, or a folder of .safetensors/.pt tensors")
