"""A Megatron distributed checkpoint's folder, as --load reads it and --save leaves it (no megatron import).

megatron-core's dist_checkpointing (the torch_dist format) writes metadata.json (naming its backend),
`.metadata` (torch DCP's index of every tensor: which bytes of which `*.distcp` file hold it) and the
`*.distcp` files. Megatron-LM saves one in DIR/iter_NNNNNNN and names the latest in
DIR/latest_checkpointed_iteration.txt; --load takes either folder. --save adds megalign.json, the model
config, so that a later --load needs no --config.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import pickle
from pathlib import Path
from typing import BinaryIO, Optional

import torch

from megalign.errors import UserError, is_int, read_user_text
from megalign.spec import REQUIRED_KEYS, ModelConfig

MODEL_FILE = "megalign.json"
FORMAT = "megalign-checkpoint"
BACKEND = "torch_dist"
BACKEND_FILE = "metadata.json"  # megatron-core's dist_checkpointing.core.CONFIG_FNAME
INDEX_FILE = ".metadata"  # torch.distributed.checkpoint's
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's
# Where DCP's index classes live; older torch wrote TensorProperties from the sharded_tensor module.
_INDEX_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                  "torch.distributed.checkpoint.filesystem", "torch.distributed._shard.sharded_tensor.metadata")
_INDEX_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


def checkpoint_folder(path: Path) -> Path:
    """The folder of the checkpoint `--load PATH` names: PATH, or the iteration Megatron-LM's tracker names."""
    if not path.is_dir():
        raise UserError(f"--load {path}: no such folder")
    if (path / TRACKER).is_file() and not (path / BACKEND_FILE).exists():
        iteration = read_user_text(path / TRACKER, "--load tracker file").strip()
        if iteration != "release" and not iteration.isdigit():
            raise UserError(f"--load {path / TRACKER}: expected an iteration number or 'release', got {iteration[:40]!r}")
        path = path / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")
    raw = _json(path / BACKEND_FILE) if (path / BACKEND_FILE).is_file() else None
    if not isinstance(raw, dict) or "sharded_backend" not in raw:
        raise UserError(f"--load {path} is not a Megatron distributed checkpoint (no {BACKEND_FILE} naming its "
                        "backend, as megatron-core's dist_checkpointing writes)")
    if raw["sharded_backend"] != BACKEND:
        raise UserError(f"--load {path}: a {raw['sharded_backend']!r} checkpoint; megatron-core reads {BACKEND} only")
    if not (path / INDEX_FILE).is_file():
        raise UserError(f"--load {path}: no {INDEX_FILE} (torch DCP's index of the tensors): an incomplete checkpoint")
    return path


def check_data_files(folder: Path) -> None:
    """Every byte range the index of the checkpoint in `folder` names lies in its file: a missing, empty or
    truncated `.distcp` (a copy cut short) is one line before the run, not megatron-core's error in every rank."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # 1-2 s of import: only for --load

    with open(folder / INDEX_FILE, "rb") as file:
        index = load_index(folder, file)
    needed: dict[str, int] = {}  # file -> the bytes it must hold
    storage = getattr(index, "storage_data", None) or {}
    for stored in storage.values() if isinstance(storage, dict) else ():
        if isinstance(stored, _StorageInfo):
            name, end = _byte_range(folder, stored)
            needed[name] = max(needed.get(name, 0), end)
    for name, size in sorted(needed.items()):
        have = (folder / name).stat().st_size if (folder / name).is_file() else None
        if have is None:
            raise UserError(f"--load {folder}: {name} is missing (its {INDEX_FILE} names it): an incomplete checkpoint")
        if have < size:
            raise UserError(f"--load {folder}: {name} holds {have} bytes of the {size} its {INDEX_FILE} names: a "
                            "truncated checkpoint")


def _byte_range(folder: Path, stored) -> tuple[str, int]:
    """(file name, end) of one byte range of the index, refused unless the name is a plain file name in
    `folder` and offset and length are byte counts: megatron-core reads whatever path the index names
    (`..`, an absolute path: files outside --load), and other types met arithmetic as a traceback."""
    name, offset, length = stored.relative_path, stored.offset, stored.length
    if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or Path(name).name != name:
        raise UserError(f"--load {folder}: its {INDEX_FILE} names {name!r}, not a file of the checkpoint's folder: a "
                        "damaged or planted index")
    if not all(is_int(n) and n >= 0 for n in (offset, length)):
        raise UserError(f"--load {folder}: its {INDEX_FILE} gives {name!r} offset {offset!r} length {length!r}, not "
                        "byte counts: a damaged index")
    return name, offset + length


def load_index(folder: Path, file: BinaryIO):
    """torch DCP's index (`.metadata`) of the checkpoint in `folder`, from `file`, unpickling nothing else."""
    try:
        return _IndexUnpickler(file).load()
    except pickle.UnpicklingError as e:
        raise UserError(f"--load {folder}: its .metadata holds {e}, which megalign does not unpickle (a torch "
                        "DCP index holds only DCP's metadata classes)") from None
    except Exception as e:  # noqa: BLE001 - a file cut short or no pickle at all: unpickling raises anything
        raise UserError(f"--load {folder}: its .metadata is not a torch DCP index ({type(e).__name__}: {e})") from None


class _IndexUnpickler(pickle.Unpickler):
    """Builds only what a torch DCP index holds: DCP's metadata dataclasses and enums, torch.Size, dtypes, layouts."""

    def find_class(self, module: str, name: str):
        if (module, name) in _INDEX_NAMES or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        if module in _INDEX_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise pickle.UnpicklingError(f"{module}.{name}")


def checkpoint_model(folder: Path, given: Optional[ModelConfig], flag: str) -> ModelConfig:
    """The model of the checkpoint in `folder`: megalign.json's, which `given` (from --config or --hf, `flag`)
    must match; without megalign.json, `given` describes it (its tensors are checked against it on load)."""
    saved = _saved_model(folder)
    if saved is None:
        if given is None:
            raise UserError(f"--load {folder} has no {MODEL_FILE} (megalign did not save it): pass --config or --hf "
                            "to describe its model")
        return given
    if given is None:
        return saved
    differ = [f"{f.name} {getattr(given, f.name)!r} (checkpoint: {getattr(saved, f.name)!r})"
              for f in dataclasses.fields(ModelConfig) if f.name != "name" and getattr(given, f.name) != getattr(saved, f.name)]
    if differ:
        raise UserError(f"{flag} describes another model than the checkpoint --load {folder}: {', '.join(differ[:3])}"
                        + (" ..." if len(differ) > 3 else ""))
    return given


def write_model(folder: Path, model: ModelConfig, saved_from: dict) -> None:
    """megalign.json beside the tensors: the model and what the weights came from (`saved_from`, for a reader)."""
    (folder / MODEL_FILE).write_text(json.dumps({"format": FORMAT, "version": 1, "model": model.to_dict(),
                                                 "saved_from": saved_from}, indent=1) + "\n")


def _saved_model(folder: Path) -> Optional[ModelConfig]:
    path = folder / MODEL_FILE
    if not path.exists():
        return None
    raw = _json(path)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("model"), dict):
        raise UserError(f"--load {path}: not a megalign checkpoint's {MODEL_FILE} (no format {FORMAT!r} and model)")
    return ModelConfig.from_dict(raw["model"], source=str(path), required=REQUIRED_KEYS)


def _json(path: Path):
    try:
        return json.loads(read_user_text(path, "--load file"))
    except ValueError as e:
        raise UserError(f"--load {path}: not valid JSON ({e})") from None
