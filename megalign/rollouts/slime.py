"""slime's and miles' rollout samples: Sample.to_dict() (slime 0.3.1, slime/utils/types.py), one a
line of JSON, or the `--save-debug-rollout-data` file, `torch.save({"rollout_id": N, "samples":
[sample.to_dict(), ...]})` (slime/observability/rollout_data_utils.py), read with weights_only=True.

    {"tokens": prompt+response, "response_length": N, "rollout_log_probs": [...] or null,
     "loss_mask": [...] or null, "status": "completed", ...}

`rollout_log_probs` is null unless the rollout kept the engine's logprobs (slime's default: the
trainer recomputes them): such a sample runs, and nothing of it is compared.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

from megalign.errors import UserError
from megalign.rollouts.jsonl import sample_of
from megalign.rollouts.sample import Sample, ids

DEBUG_ROLLOUT_KEYS = {"rollout_id", "samples"}


def detect(item: dict) -> bool:
    return {"tokens", "response_length", "rollout_log_probs"} <= item.keys()


def read(item: dict, where: str, hf: Any = None) -> list[Sample]:
    tokens, length = ids(item["tokens"], f"{where}: tokens"), item["response_length"]
    if not (isinstance(length, int) and 0 < length < len(tokens)):
        raise UserError(f"{where}: response_length must be between 1 and the token count - 1, got {length!r}")
    return [sample_of(tokens[:-length], tokens[-length:], item["rollout_log_probs"], item.get("loss_mask"), where)]


def _load(path: Path) -> Any:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def is_debug_rollout(path: Path) -> bool:
    """A `.pt` that is slime's debug rollout file, not a plain tensor file (either may be given to compare)."""
    try:
        content = _load(path)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile):
        return False
    return isinstance(content, dict) and DEBUG_ROLLOUT_KEYS <= content.keys()


def load_debug_rollout(path: Path) -> list:
    """The samples of a `--save-debug-rollout-data` file."""
    try:
        content = _load(path)
    except FileNotFoundError:
        raise UserError(f"rollout file not found: {path}") from None
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        # weights_only refuses anything but tensors and plain containers: a file that needs more is not slime's
        raise UserError(f"{path}: not a torch.save file that loads with weights_only=True "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not (isinstance(content, dict) and DEBUG_ROLLOUT_KEYS <= content.keys() and isinstance(content["samples"], list)):
        raise UserError(f"{path}: a .pt rollout file is slime's --save-debug-rollout-data "
                        "({'rollout_id': N, 'samples': [...]}), not this")
    return [_plain(sample) for sample in content["samples"]]


def _plain(sample: Any) -> Any:
    """Tensors among a sample's token fields as lists (to_dict keeps what the rollout stored)."""
    import torch

    if not isinstance(sample, dict):
        return sample
    return {k: v.tolist() if isinstance(v, torch.Tensor) and k in ("tokens", "rollout_log_probs", "loss_mask") else v
            for k, v in sample.items()}
