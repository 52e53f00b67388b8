"""megalign's dump format: per-rank safetensors files, a manifest per rank, and dump.json.

    OUT/
      dump.json                 what ran: stack, mode, layout, model, tokens; written last by rank 0
      rank-00000/
        manifest.json           every tensor record of this rank; written last, atomically
        tensors-00000.safetensors
        tensors-00001.safetensors ...

Values live in safetensors (no pickle, memory-mappable); tensor names live only inside JSON and
safetensors keys, never in file names. A rank folder without manifest.json, or a dump without
dump.json, is incomplete and is refused by `DumpFiles.open` (reader.py); writer.py writes one rank.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from enum import StrEnum
from typing import Optional

import numpy as np
import torch

from megalign.dump.sketch import encode, finite
from megalign.dump.sharding import Sharding
from megalign.dump.stats import TensorStats

FORMAT = "megalign-dump"
# 2: stats-only records keep a sketch (sketch.py). Readers take every version of VERSIONS.
VERSION = 2
VERSIONS = (1, 2)
DUMP_META = "dump.json"
MANIFEST = "manifest.json"

class Kind(StrEnum):
    """What a dumped tensor is (a record's `kind`, compare's report): the one list of kinds."""

    INPUT = "input"
    ACTIVATION = "activation"
    ACTIVATION_GRAD = "activation_grad"
    PARAM_GRAD = "param_grad"
    LOGITS = "logits"
    LOGPROBS = "logprobs"
    LOSS = "loss"
    ROUTING = "routing"
    PARAM = "param"  # a parameter's value, at the end of a Dumper step (before the optimizer step)

    def __repr__(self) -> str:
        # A kind reads as its string everywhere (messages, reports), whether it came from a file or from here.
        return repr(self.value)


KINDS: tuple[str, ...] = tuple(kind.value for kind in Kind)


def write_json_atomic(path: Path, payload: dict, indent: Optional[int] = 1) -> None:
    """Write to a temporary file beside `path`, then rename: readers see all of it or nothing.
    `indent=None`: compact, through json's C encoder (a manifest of 1,600 records took 0.12 s
    indented, measured: as much as a small model's training step)."""
    write_text_atomic(path, json.dumps(payload, indent=indent, separators=None if indent else COMPACT))


COMPACT = (",", ":")  # json's separators of a compact file


def write_text_atomic(path: Path, text: str) -> None:
    """write_json_atomic's way, for text made already."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rank_dirname(rank: int) -> str:
    return f"rank-{rank:05d}"


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp_rank: int = 0
    cp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0


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
    # xxh3_128 of the tensor's bytes, hex: replicas with equal hashes are read once (compare/plan.py)
    hash: Optional[str] = None
    # An activation gradient's: the order its output's forward call had. Backward reaches the calls of
    # a module in reverse, so a name's repeats are numbered by this, not by when the gradient came.
    call: Optional[int] = None
    # A stats-only record's: its shard's sketch at its positions in the whole (sketch.py); absent in version 1.
    sketch: Optional[np.ndarray] = field(default=None, compare=False)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "order": self.order, "shape": self.shape,
                "dtype": self.dtype, "sharding": self.sharding.to_dict(), "module": self.module,
                "layer": self.layer, "file": self.file, "key": self.key,
                "stats": self.stats.to_dict() if self.stats else None, "hash": self.hash,
                **({} if self.call is None else {"call": self.call}),
                **({} if finite(self.sketch) is None else {"sketch": encode(self.sketch)})}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# A run's precision as dump.json and --dtype name it (thresholds are set per precision), narrowest first,
# and the torch dtype it computes in: the one table of precision names.
PRECISION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
PRECISIONS = tuple(PRECISION_DTYPES)
_PRECISION_OF_DTYPE = {dtype_name(dtype): precision for precision, dtype in PRECISION_DTYPES.items()}


def precision_name(dtype: str) -> Optional[str]:
    """`bfloat16` (a stored dtype) or `bf16` (a run's) -> `bf16`; None for what is not a float."""
    return dtype if dtype in PRECISIONS else _PRECISION_OF_DTYPE.get(dtype)



# A name recorded again (a module called twice, a name added again) is read back as `name@1`, `name@2`,
# ...: the one rule for a repeat's name. A name given to a writer may not end so, or it would be read
# as another name's repeat (the Dumper refuses it, the reader too).
REPEAT = re.compile(r"@\d+$")


def repeat_name(name: str, repeat: int) -> str:
    """The name of the `repeat`th record of `name` (0: the first, named plainly)."""
    return name if repeat == 0 else f"{name}@{repeat}"


# A parameter gradient's name with this suffix holds it as the optimizer stepped on it, where that
# differs from the value at the reduction, under the parameter's own name (capture/grad_reads.py).
STEPPED = "#stepped"


def check_name(name: str) -> Optional[str]:
    """Why `name` cannot be a tensor's name (it reads as a repeat), or None."""
    if "@" in name and REPEAT.search(name):
        return f"{name!r} ends as megalign names a name's repeats (name@1, name@2, ...): give it another name"
    return None


_LAYER = re.compile(r"layers\.(\d+)(?:\.|$)")


@functools.lru_cache(maxsize=65536)  # asked of every tensor a step: the names repeat
def layer_of(name: str) -> Optional[int]:
    """The layer index in a tensor name (`decoder.layers.3.mlp` -> 3), for any stack's naming."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None
