"""`compare A B --reference R`: a float64 run of the same model and tokens measures each side's own rounding.

Without a reference, the threshold on rel(A, B) must allow for the rounding of both runs at once,
however it adds up. With one, each side is measured against the float64 result: rel(A, R) and
rel(B, R) are each run's own rounding error (R's float64 rounding is some 10^9 times smaller). A
side is *off* when its error exceeds the rounding BUDGET of its precision for that kind of tensor,
and a tensor fails when a side is off; the row says which, A, B or both. A and B may then differ
by as much as their rounding explains, whichever way each rounded: a difference rounding cannot
explain puts at least one side over its budget (the triangle inequality).

The budgets are the largest rounding errors measured on a real trained model (SmolLM2-135M, both
stacks, CP/TP/PP layouts, fp32 and bf16, `bench/calibrate.py`) times a margin, and sit far below
what the planted bugs of the tests do (docs/compare.md, "Verdicts on a real model").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megalign.compare.entries import Source
from megalign.compare.thresholds import sized
from megalign.dump.format import Kind
from megalign.errors import UserError

# The largest distance to R seen on the real model (bench/calibrate.py, 28 texts, five layouts) times a
# margin of 2 or more. fp32: everything within 1/30 of its budget; bf16: activations 1.3e-2, logits 8.4e-3,
# logprobs 1.7e-3, the loss 2.5e-5, parameter gradients 0.02 (matrices) and up to 0.5 on 576-element norm
# weights (thresholds.SMALL widens the budget of a vector as it does its threshold).
BUDGET: dict[str, dict[str, float]] = {
    "fp64": {Kind.INPUT: 0.0, Kind.ACTIVATION: 1e-16, Kind.ACTIVATION_GRAD: 1e-16, Kind.PARAM_GRAD: 1e-16,
             Kind.PARAM: 1e-16, Kind.LOGITS: 1e-16, Kind.LOGPROBS: 1e-16,
             Kind.LOSS: 1e-16},  # thresholds.py: fp64 runs on other devices differ by 3e-19
    "fp32": {Kind.INPUT: 0.0, Kind.ACTIVATION: 1e-9, Kind.ACTIVATION_GRAD: 1e-7, Kind.PARAM_GRAD: 1e-5,
             Kind.PARAM: 1e-5, Kind.LOGITS: 1e-9, Kind.LOGPROBS: 1e-9, Kind.LOSS: 1e-9},
    "bf16": {Kind.INPUT: 0.0, Kind.ACTIVATION: 3e-2, Kind.ACTIVATION_GRAD: 3e-2, Kind.PARAM_GRAD: 1e-1,
             Kind.PARAM: 1e-1, Kind.LOGITS: 2e-2, Kind.LOGPROBS: 4e-3, Kind.LOSS: 5e-5},
}
# Model config entries a reference may differ in: the name, and the constants a checkpoint's config.json
# may get wrong without changing any tensor's shape, which is what a reference is there to pin on a side
# (docs/compare.md: `rms_norm_eps` 1e-6 on one side is "B off"). Every other entry (sizes, experts, switches,
# the init std of seeded weights) must match A's and B's.
JUDGED = ("name", "layernorm_epsilon", "rotary_base")


@dataclass
class ReferenceVerdict:
    rel_a: float  # rel(A, R)
    rel_b: float  # rel(B, R)
    off: Optional[str]  # "A", "B", "both" or None


def judge(kind: str, shape: list[int], rel_a: float, rel_b: float, precision_a: str,
          precision_b: str) -> ReferenceVerdict:
    """Which side's distance to the reference is over its budget (for a tensor of `shape`: thresholds.sized);
    NaN (NaN where R has a number) is off."""
    def off(rel: float, precision: str) -> bool:
        return not rel <= sized(BUDGET, precision, kind, shape)

    sides = [side for side, rel, precision in (("A", rel_a, precision_a), ("B", rel_b, precision_b))
             if off(rel, precision)]
    return ReferenceVerdict(rel_a=rel_a, rel_b=rel_b, off="both" if len(sides) == 2 else (sides[0] if sides else None))


def check_reference(reference: Source, a: Source, b: Source) -> None:
    """A reference of another model, other weights or other inputs would judge nothing but that
    difference: UserError (exit 2), naming the first difference."""
    if reference.precision not in (None, "fp64"):
        raise UserError(f"--reference {reference.path}: a {reference.precision} run; the reference is an fp64 run "
                        "(megalign forward|backward --dtype fp64)")
    for side in (a, b):
        if side.model and reference.model:
            differ = sorted(k for k in set(side.model) | set(reference.model)
                            if k not in JUDGED and side.model.get(k) != reference.model.get(k))
            if differ:
                raise UserError(f"--reference {reference.path} is another model than {side.path}: "
                                + ", ".join(f"{k} {reference.model.get(k)} vs {side.model.get(k)}" for k in differ))
        if side.weights and reference.weights and side.weights != reference.weights:
            raise UserError(f"--reference {reference.path} has other weights than {side.path}: "
                            f"{reference.weights} vs {side.weights}")
        name = _other_input(reference, side)
        if name:
            raise UserError(f"--reference {reference.path} ran on other {name} than {side.path} (its input differs)")


def _other_input(reference: Source, side: Source) -> Optional[str]:
    """The first input tensor the two hold (lined up, lineup.py) whose values differ."""
    inputs = {e.name: e for e in side.entries if e.kind == Kind.INPUT and not e.apart}
    for entry in reference.entries:
        mine = inputs.get(entry.name) if entry.kind == Kind.INPUT and not entry.apart else None
        if mine is None:
            continue
        x, y = entry.load().tensor, mine.load().tensor
        if x is not None and y is not None and not (x.shape == y.shape and torch.equal(x.double(), y.double())):
            return entry.name
    return None
