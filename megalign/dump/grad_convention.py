"""How a run's parameter gradients were reduced over its data-parallel ranks, recorded, not assumed.

torch's DDP and FSDP2 average by default: the reduced gradient is the ranks' sum divided by their
number, so the loss that trains on the whole batch is each rank's share times the world size, and
every activation gradient of such a run is that many times the one-process one. compare divides the
activation gradients by the recorded divisor before judging (compare/objective.py), so that the
standard idioms pass as written and a loss that does not match its reduction fails where it starts.

Read where the Dumper can: a torch DDP averages over its process group (a comm hook it was given
replaces that: unknown, unless stated); FSDP2's divide factor is read from each FSDP module's
parameter groups (torch 2.13: `_get_fsdp_state()._fsdp_param_groups[i].gradient_divide_factor`,
None meaning the mesh's data-parallel size). megatron-core's DDP (megatron-core 0.18) scales each
buffer's gradients by its `gradient_scaling_factor` before the collective, which averages over the
buffer's group where `average_in_collective`: at its defaults 1/(DP x CP) then a sum, a mean. With
`calculate_per_token_loss` it sums, and megatron's schedule hands the step's token count to
finalize_model_grads, which divides by it through `scale_gradients`: read each step it runs in, the
step's divisor. The user states it for anything else (`Dumper(grad_reduction="sum" | "mean" | a
divisor)`, MEGALIGN_GRAD_REDUCTION). dump.json's `grad_reduction`: {"divide_by": a number or null
(unknown), "by": what said so, "per_step": {step: its divisor} where it changes by step}; dumps
without it (older ones, megalign's own runs) are read as summed (divide_by 1).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

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
    per_step: tuple[tuple[int, float], ...] = ()  # (step, divisor) where a step's differs (a token count)

    def to_dict(self) -> dict:
        steps = {"per_step": {str(step): divisor for step, divisor in self.per_step}} if self.per_step else {}
        return {"divide_by": self.divide_by, "by": self.by, **steps}

    def divisor(self, step: Optional[int]) -> Optional[float]:
        return dict(self.per_step).get(step, self.divide_by)

    def describe(self) -> str:
        """For compare's header."""
        if self.per_step:
            return f"grads /tokens a step ({self.by}): act grads /" + ", /".join(f"{d:g}" for _, d in self.per_step)
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
        per_step = raw.get("per_step", {})
        if not isinstance(per_step, dict) or not all(
                step.isdigit() and is_number(d) and math.isfinite(d) and d > 0 for step, d in per_step.items()):
            raise Malformed(f"{where}: {META_KEY}.per_step must map steps to positive numbers, got {per_step!r}")
        return cls(divide_by=None if divide_by is None else float(divide_by), by=raw["by"],
                   per_step=tuple(sorted((int(step), float(d)) for step, d in per_step.items())))


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
        # megatron-core DDPs: each one's scale_gradients factors by step (tensors, read at close)
        self._megatron: list[tuple[weakref.ref, dict[int, list[torch.Tensor]]]] = []

    def watch(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self._ddps.add(module)
        self._fsdps.update(m for m in module.modules() if hasattr(m, "_get_fsdp_state"))

    def reduce_in_backward(self) -> bool:
        """Whether a watched torch DDP or FSDP2 reduces the gradients by the end of backward."""
        return bool(self._ddps) or bool(self._fsdps)

    def watch_megatron(self, ddp: torch.nn.Module, step_now: Callable[[], Optional[int]]) -> None:
        """A megatron-core DDP: its factors of `scale_gradients` (finalize_model_grads' 1/tokens) in
        each step `step_now()` names (None: a step not dumped), until `release()`."""
        if any(ref() is ddp for ref, _ in self._megatron):
            return
        scales: dict[int, list[torch.Tensor]] = {}
        scale = ddp.scale_gradients

        def scale_gradients(factor) -> None:
            if (step := step_now()) is not None:  # kept on its device: no read-back mid-step
                scales.setdefault(step, []).append(torch.as_tensor(factor).detach().clone())
            scale(factor)

        ddp.scale_gradients = scale_gradients
        self._megatron.append((weakref.ref(ddp), scales))

    def release(self) -> None:
        """megatron DDPs' scale_gradients as they were."""
        for ref, _ in self._megatron:
            if (ddp := ref()) is not None:
                ddp.__dict__.pop("scale_gradients", None)

    def reduction(self, stated: Stated, dp: int) -> Optional[GradReduction]:
        """What the run did: as stated, else as the reducers say (one divisor, or unknown where they
        differ); None where nothing reduced gradients over ranks and nothing was stated."""
        if stated is not None:
            divide_by = {"sum": 1, "mean": dp}.get(stated, stated)
            return GradReduction(float(divide_by), f"stated: {stated}")
        groups = [group for m in self._fsdps for group in m._get_fsdp_state()._fsdp_param_groups]
        megatron = [_megatron(ddp, scales) for ref, scales in self._megatron if (ddp := ref()) is not None]
        return _one([*map(_ddp, self._ddps), *map(_divide_factor, groups), *megatron])


def _megatron(ddp, scales: dict[int, list[torch.Tensor]]) -> GradReduction:
    """A megatron-core DDP's divisor: of every buffer, 1/its scaling factor, times its group's size
    where the collective averages (one for all of them, else unknown); per step, over the factors
    scale_gradients was given."""
    average = ddp.ddp_config.average_in_collective
    divisors = {(b.data_parallel_world_size if average else 1) / b.gradient_scaling_factor
                for b in ddp.buffers + ddp.expert_parallel_buffers}
    if len(divisors) != 1:
        return GradReduction(None, "megatron DDP, buffers of different scaling factors")
    base = round(divisors.pop(), 9)  # 1 / (1/3) is 3.0000000000000004
    if not scales:
        how = "summed" if base == 1 else _mean(int(base)) if base.is_integer() else f"scaled by 1/{base:g}"
        return GradReduction(float(base), f"megatron DDP, {how}")
    # A factor is 1/tokens in the gradients' dtype (float32: 1/19 reads back as 1/18.9999998)
    per_step = tuple((step, float(f"{base / math.prod(float(f) for f in factors):.7g}"))
                     for step, factors in sorted(scales.items()))
    return GradReduction(float(base), "megatron DDP, per-token loss", per_step)


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
    divisors = {(r.divide_by, r.per_step) for r in found}
    if len(divisors) == 1:
        return found[0]
    return GradReduction(None, "reducers of different divisors: " + "; ".join(r.by for r in found))
