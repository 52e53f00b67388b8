"""How the Dumper finds a run's gradient reduction (dump/grad_convention.py's record): read from the
modules that reduce, each by its framework's adapter (torch's DDP and FSDP2: torch_adapter.py;
megatron-core's DDP: megatron_adapter.py), or as the user states it for anything else
(`Dumper(grad_reduction="sum" | "mean" | a divisor)`, MEGALIGN_GRAD_REDUCTION).
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Iterable, Optional, Union

import torch

from megalign.capture.megatron_adapter import GradScaling
from megalign.capture.torch_adapter import ddp_reduction, fsdp_modules, fsdp_reductions
from megalign.dump.grad_convention import GradReduction
from megalign.errors import is_number

Stated = Union[str, float, int, None]


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
    """The gradient reducers a Dumper watched (torch DDPs, FSDP2 modules, megatron-core DDPs), read
    when dump.json is written: a comm hook or a divide factor set after watch() counts."""

    def __init__(self):
        self._ddps: weakref.WeakSet = weakref.WeakSet()
        self._fsdps: weakref.WeakSet = weakref.WeakSet()
        self._megatron: list[GradScaling] = []

    def watch(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self._ddps.add(module)
        self._fsdps.update(fsdp_modules(module))

    def reduce_in_backward(self) -> bool:
        """Whether a watched torch DDP or FSDP2 reduces the gradients by the end of backward."""
        return bool(self._ddps) or bool(self._fsdps)

    def watch_megatron(self, ddp: torch.nn.Module, step_now: Callable[[], Optional[int]]) -> None:
        """A megatron-core DDP, its scaling read in each step `step_now()` names, until `release()`."""
        if not any(scaling.of(ddp) for scaling in self._megatron):
            self._megatron.append(GradScaling(ddp, step_now))

    def release(self) -> None:
        """megatron DDPs' scale_gradients as they were."""
        for scaling in self._megatron:
            scaling.release()

    def reduction(self, stated: Stated, dp: int) -> Optional[GradReduction]:
        """What the run did: as stated, else as the reducers say (one divisor, or unknown where they
        differ); None where nothing reduced gradients over ranks and nothing was stated."""
        if stated is not None:
            divide_by = {"sum": 1, "mean": dp}.get(stated, stated)
            return GradReduction(float(divide_by), f"stated: {stated}")
        return _one([*map(ddp_reduction, self._ddps), *(r for m in self._fsdps for r in fsdp_reductions(m)),
                     *filter(None, (scaling.reduction() for scaling in self._megatron))])


def _one(found: Iterable[GradReduction]) -> Optional[GradReduction]:
    found = list(dict.fromkeys(found))
    if not found:
        return None
    divisors = {(r.divide_by, r.per_step) for r in found}
    if len(divisors) == 1:
        return found[0]
    return GradReduction(None, "reducers of different divisors: " + "; ".join(r.by for r in found))
