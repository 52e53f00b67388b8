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
what the planted bugs of the tests do (README, "Verdicts on a real model").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megalign.alignment.compare.entries import Entry, Source
from megalign.alignment.errors import UserError

# The largest distance to R seen on the real model (bench/calibrate.py) times a margin. fp32: activations,
# logits, logprobs and the loss within 1e-11 of R, parameter gradients 4e-7 (transformers; megatron-core's
# 3e-10); bf16: activations 1.7e-3, logits 2e-4, parameter gradients 0.04.
BUDGET: dict[str, dict[str, float]] = {
    "fp64": {"input": 0.0, "activation": 1e-16, "activation_grad": 1e-16, "param_grad": 1e-16, "logits": 1e-16,
             "logprobs": 1e-16, "loss": 1e-16},  # thresholds.py: fp64 runs on other devices differ by 3e-19
    "fp32": {"input": 0.0, "activation": 1e-9, "activation_grad": 1e-7, "param_grad": 1e-5, "logits": 1e-9,
             "logprobs": 1e-9, "loss": 1e-9},
    "bf16": {"input": 0.0, "activation": 1e-2, "activation_grad": 2e-2, "param_grad": 1e-1, "logits": 2e-3,
             "logprobs": 2e-3, "loss": 1e-5},
}
# The sizes that make two runs the same model: a reference must share them with A and B.
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "kv_channels")


@dataclass
class ReferenceVerdict:
    rel_a: float  # rel(A, R)
    rel_b: float  # rel(B, R)
    off: Optional[str]  # "A", "B", "both" or None


def judge(kind: str, rel_a: float, rel_b: float, precision_a: str, precision_b: str) -> ReferenceVerdict:
    """Which side's distance to the reference is over its budget; NaN (NaN where R has a number) is off."""
    def off(rel: float, precision: str) -> bool:
        budgets = BUDGET[precision]
        return not rel <= budgets.get(kind, budgets["activation"])

    sides = [side for side, rel, precision in (("A", rel_a, precision_a), ("B", rel_b, precision_b))
             if off(rel, precision)]
    return ReferenceVerdict(rel_a=rel_a, rel_b=rel_b, off="both" if len(sides) == 2 else (sides[0] if sides else None))


def check_reference(reference: Source, a: Source, b: Source) -> None:
    """A reference of another model or other tokens would judge nothing: UserError (exit 2)."""
    if reference.precision not in (None, "fp64"):
        raise UserError(f"--reference {reference.path}: a {reference.precision} run; the reference is an fp64 run "
                        "(megalign forward|backward --dtype fp64)")
    for side in (a, b):
        if side.model and reference.model:
            differ = [k for k in MODEL_KEYS if side.model.get(k) != reference.model.get(k)]
            if differ:
                raise UserError(f"--reference {reference.path} is another model than {side.path}: "
                                + ", ".join(f"{k} {reference.model.get(k)} vs {side.model.get(k)}" for k in differ))
        mine, theirs = _tokens(side), _tokens(reference)
        if mine is not None and theirs is not None and not (mine.shape == theirs.shape and torch.equal(mine, theirs)):
            raise UserError(f"--reference {reference.path} ran on other tokens than {side.path}")


def _tokens(source: Source) -> Optional[torch.Tensor]:
    entry: Optional[Entry] = next((e for e in source.entries if (e.kind, e.name) == ("input", "tokens")), None)
    return entry.load().tensor if entry is not None else None
