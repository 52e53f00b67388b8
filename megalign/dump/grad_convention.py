"""How a run's parameter gradients were reduced over its data-parallel ranks, recorded, not assumed.

torch's DDP and FSDP2 average by default: the reduced gradient is the ranks' sum divided by their
number, so the loss that trains on the whole batch is each rank's share times the world size, and
every activation gradient of such a run is that many times the one-process one. compare divides the
activation gradients by the recorded divisor before judging (compare/objective.py), so that the
standard idioms pass as written and a loss that does not match its reduction fails where it starts.

Read where the Dumper can: a torch DDP averages over its process group (a comm hook it was given
replaces that: unknown, unless stated); FSDP2's divide factor is read from each FSDP module's
parameter groups (torch 2.13: `_get_fsdp_state()._fsdp_param_groups[i].gradient_divide_factor`,
None meaning the mesh's data-parallel size). The user states it for anything else
(`Dumper(grad_reduction="sum" | "mean" | a divisor)`, MEGALIGN_GRAD_REDUCTION). dump.json's
`grad_reduction`: {"divide_by": a number or null (unknown), "by": what said so}; dumps without it
(older ones, megalign's own runs) are read as summed (divide_by 1).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch

from megalign.dump.validate import Malformed
from megalign.errors import is_number

META_KEY = "grad_reduction"
Stated = Union[str, float, int, None]


@dataclass(frozen=True)
class GradReduction:
    """The divisor of the ranks' summed gradients (None: unknown), and what said so."""

    divide_by: Optional[float]
    by: str

    def to_dict(self) -> dict:
        return {"divide_by": self.divide_by, "by": self.by}

    def describe(self) -> str:
        """For compare's header."""
        if self.divide_by is None:
            return f"grads reduced as not recorded ({self.by}): act grads as dumped"
        if self.divide_by == 1:
            return f"grads summed ({self.by})"
        return f"grads /{self.divide_by:g} ({self.by}): act grads /{self.divide_by:g}"

    @classmethod
    def from_meta(cls, meta: dict, where: str) -> Optional["GradReduction"]:
        """dump.json's record; None where it has none."""
        raw = meta.get(META_KEY)
        if raw is None:
            return None
        divide_by = raw.get("divide_by") if isinstance(raw, dict) else 0
        if not isinstance(raw, dict) or not isinstance(raw.get("by"), str) or \
                not (divide_by is None or (is_number(divide_by) and math.isfinite(divide_by) and divide_by > 0)):
            raise Malformed(f"{where}: {META_KEY} must be {{\"divide_by\": a positive number or null, \"by\": text}}, "
                            f"got {raw!r}")
        return cls(divide_by=None if divide_by is None else float(divide_by), by=raw["by"])


def check_stated(stated: Stated, where: str = "grad_reduction") -> Stated:
    """The user's statement: "sum", "mean", or a positive divisor (a number, or its text from the environment)."""
    if isinstance(stated, str) and stated not in ("sum", "mean"):
        try:
            stated = float(stated)
        except ValueError:
            pass
    if stated is None or stated in ("sum", "mean") or \
            (is_number(stated) and math.isfinite(stated) and stated > 0):
        return stated
    raise ValueError(f"{where}: \"sum\", \"mean\" or a positive number (the divisor of the ranks' summed "
                     f"gradients), got {stated!r}")


class Reducers:
    """The gradient reducers a Dumper watched (torch DDPs, FSDP2 modules), read when dump.json is
    written: a comm hook or a divide factor set after watch() counts."""

    def __init__(self):
        self._ddps: weakref.WeakSet = weakref.WeakSet()
        self._fsdps: weakref.WeakSet = weakref.WeakSet()

    def watch(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self._ddps.add(module)
        self._fsdps.update(m for m in module.modules() if hasattr(m, "_get_fsdp_state"))

    def reduction(self, stated: Stated, dp: int) -> Optional[GradReduction]:
        """What the run did: as stated, else as the reducers say (one divisor, or unknown where they
        differ); None where nothing reduced gradients over ranks and nothing was stated."""
        if stated is not None:
            divide_by = {"sum": 1, "mean": dp}.get(stated, stated)
            return GradReduction(float(divide_by), f"stated: {stated}")
        groups = [group for m in self._fsdps for group in m._get_fsdp_state()._fsdp_param_groups]
        return _one([*map(_ddp, self._ddps), *map(_divide_factor, groups)])


def _ddp(ddp: torch.nn.parallel.DistributedDataParallel) -> GradReduction:
    if ddp._comm_hooks:  # torch 2.13 keeps register_comm_hook's hooks there
        return GradReduction(None, "torch DDP's comm hook: say it with grad_reduction=")
    return GradReduction(float(ddp.process_group.size()), f"torch DDP, {_mean(ddp.process_group.size())}")


def _divide_factor(group) -> GradReduction:
    """FSDP2's divisor of one parameter group: its gradient_divide_factor, else (torch's
    _get_gradient_divide_factors) the data-parallel size: the shard group's, times HSDP's replicas."""
    if group.gradient_divide_factor is not None:
        return GradReduction(float(group.gradient_divide_factor), f"FSDP2, divide factor {group.gradient_divide_factor:g}")
    info = group.mesh_info
    size = getattr(info, "shard_mesh_size", 1) * getattr(info, "replicate_mesh_size", 1)
    return GradReduction(float(size), f"FSDP2, {_mean(size)}")


def _mean(ranks: int) -> str:
    return "one rank" if ranks == 1 else f"mean of {ranks} ranks"


def _one(found: Iterable[GradReduction]) -> Optional[GradReduction]:
    found = list(dict.fromkeys(found))
    if not found:
        return None
    divisors = {r.divide_by for r in found}
    if len(divisors) == 1:
        return found[0]
    return GradReduction(None, "reducers of different divisors: " + "; ".join(r.by for r in found))
