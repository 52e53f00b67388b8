"""Activation gradients brought onto the scale of the global objective, by each run's recorded
gradient reduction (dump/grad_convention.py), before they are judged.

Under an averaging reduction (torch DDP's and FSDP2's defaults) the loss that trains on the whole
batch is each rank's share times the number of ranks, and every activation gradient is that many
times the one-process one; the parameter gradients, reduced, are not. Each side's activation
gradients are divided by its divisor (its step's, where it changes by step: megatron's per-token
loss): a correct run then agrees with one process, and a loss whose
normalisation does not match its reduction fails at the first tensor it moves. A side whose
reduction is unknown (a comm hook not stated) is compared as dumped; the header says which
convention each side used.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megalign.compare.entries import Entry, Source, Value
from megalign.dump.format import DUMP_META, Kind
from megalign.dump.grad_convention import GradReduction


def on_objective_scale(*sources: Optional[Source]) -> list[Optional[Source]]:
    """The sources with their activation gradients divided by their recorded divisors, and each
    megalign dump's header saying its reduction; unchanged where none is recorded."""
    return [None if s is None else _rescaled(s) for s in sources]


def _rescaled(source: Source) -> Source:
    reduction = None if source.dump is None else GradReduction.from_meta(source.dump.meta,
                                                                         str(source.path / DUMP_META))
    if reduction is None:
        return source
    described = replace(source, description=f"{source.description}, {reduction.describe()}")
    return replace(described, entries=[_divided(e, divisor) if e.kind == Kind.ACTIVATION_GRAD
                                       and (divisor := reduction.divisor(e.step)) not in (None, 1) else e
                                       for e in source.entries])


def _divided(entry: Entry, divisor: float) -> Entry:
    def load(**where) -> Value:
        value = entry.load(**where)
        if value.tensor is not None:
            return replace(value, tensor=value.tensor / divisor)
        if value.stats is not None:  # --stats-only: every statistic scales with the values
            s = value.stats
            value = replace(value, stats=replace(s, sum=s.sum / divisor, sum_sq=s.sum_sq / divisor ** 2,
                                                 abs_sum=s.abs_sum / divisor, min=s.min / divisor,
                                                 max=s.max / divisor))
        if value.sketch is not None:  # a sketch is linear in the values
            value = replace(value, sketch=value.sketch / divisor)
        return value

    # Read into no caller's buffer: the quotient is a tensor of its own.
    return replace(entry, load=load, nbytes=None)
