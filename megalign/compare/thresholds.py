"""Which relative difference a tensor may have before it counts as diverged.

The threshold applies to the relative difference (metrics.py), for every kind. The defaults are
calibrated on a real trained model (SmolLM2-135M: transformers against megatron-core at TP=3, CP=2,
TP=3+SP, PP=2 and packed rows, fp32 and bf16, 28 texts, `bench/calibrate.py`): each is at least twice
the largest difference seen there, 12 texts not fitted on pass too, and each planted bug of the tests
stays caught (docs/compare.md, "Verdicts on a real model"). Seen in fp32: activations and logits up to
1.7e-11, parameter gradients 1.6e-7 (the input norms of the last layers, where a "massive activation"
channel reaches 22,000). Seen in bf16: activations and logits 8.5e-3 (fp32 against bf16 weights),
logprobs 1.4e-3, the loss 1.8e-5, parameter gradients 0.019 (matrices) and 0.43 (576-element norm
weights: SMALL). Inputs must match exactly.
Precedence: a matching --tolerance pattern (the last one given wins), then --threshold, then the
per-kind default.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from megalign.dump.format import Kind, precision_name
from megalign.errors import UserError, compile_pattern

DEFAULTS: dict[str, dict[str, float]] = {
    "fp32": {Kind.INPUT: 0.0, Kind.ACTIVATION: 1e-8, Kind.ACTIVATION_GRAD: 1e-7, Kind.PARAM_GRAD: 1e-5,
             Kind.PARAM: 1e-5, Kind.LOGITS: 1e-8, Kind.LOGPROBS: 1e-8, Kind.LOSS: 1e-9},
    "bf16": {Kind.INPUT: 0.0, Kind.ACTIVATION: 2e-2, Kind.ACTIVATION_GRAD: 2e-2, Kind.PARAM_GRAD: 1e-1,
             Kind.PARAM: 1e-1, Kind.LOGITS: 2e-2, Kind.LOGPROBS: 3e-3, Kind.LOSS: 4e-5},
    # Both sides float64 (reference runs against each other): 1e-29 on one device, but up to 3e-19
    # between CUDA and the CPU, since megatron computes RoPE's cos and sin in float32 (measured on an H200).
    "fp64": {Kind.INPUT: 0.0, Kind.ACTIVATION: 1e-16, Kind.ACTIVATION_GRAD: 1e-16, Kind.PARAM_GRAD: 1e-16,
             Kind.PARAM: 1e-16, Kind.LOGITS: 1e-16, Kind.LOGPROBS: 1e-16, Kind.LOSS: 1e-16},
}
# A vector parameter's gradient (a norm's weight, a bias) is, channel by channel, a sum over every token,
# and its rounding is far from independent: a 576-element norm weight's gradient, where a "massive
# activation" channel dominates, moves by up to 0.43 (rel diff) between transformers' fp32 and bf16 runs,
# where the matrices move by 0.02 at most (bench/calibrate.py). Such a kind's threshold for a vector of n
# elements is max(default, SMALL/sqrt(n)), and so is its rounding budget against a reference.
SMALL: dict[str, dict[str, float]] = {"bf16": {Kind.PARAM_GRAD: 24.0, Kind.PARAM: 24.0}}


def sized(table: dict[str, dict[str, float]], precision: str, kind: str, shape: list[int]) -> float:
    """`table`'s value (DEFAULTS, or reference.BUDGET) for a tensor of `shape`: the kind's (an
    activation's for kinds of foreign dumps), widened for a vector where SMALL says."""
    values = table[precision]
    spread = SMALL.get(precision, {}).get(kind)
    base = values.get(kind, values[Kind.ACTIVATION])
    return max(base, spread / math.sqrt(max(shape[0], 1))) if spread and len(shape) == 1 else base


def precision_of(*dtypes: Optional[str]) -> str:
    """'bf16' when any side ran in 16-bit floats (the looser defaults), 'fp64' when all are float64,
    else 'fp32'."""
    known = [precision_name(d) for d in dtypes if d]
    if any(p in ("fp16", "bf16") for p in known):
        return "bf16"
    return "fp64" if known and all(p == "fp64" for p in known) else "fp32"


def run_precision(run: Optional[str], stored: str) -> str:
    """A side's precision: its run's dtype (dump.json), which also sets the threshold of a tensor the
    run stored at another dtype (a run in fp32 that stored one tensor as bf16 is still judged as fp32
    runs are); the stored dtype only where the format records no run dtype (plain files)."""
    return precision_of(run or stored)


def check_threshold(option: str, value: float) -> float:
    """A relative difference is finite and >= 0: NaN would fail every tensor, a negative one too."""
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{option}: a threshold must be a finite number >= 0, got {value}")
    return value


@dataclass
class Thresholds:
    override: Optional[float] = None
    patterns: list[tuple[re.Pattern, float]] = field(default_factory=list)

    @classmethod
    def from_cli(cls, threshold: Optional[float], tolerances: list[str]) -> "Thresholds":
        patterns = []
        for text in tolerances:
            pattern, sep, value = text.rpartition("=")
            if not sep or not pattern:
                raise UserError(f"--tolerance {text!r}: expected REGEX=VALUE, e.g. 'layers\\.1\\.=1e-3'")
            regex = compile_pattern("--tolerance", pattern)
            try:
                number = float(value)
            except ValueError:
                raise UserError(f"--tolerance {text!r}: {value!r} is not a number") from None
            patterns.append((regex, check_threshold(f"--tolerance {text!r}", number)))
        if threshold is not None:
            check_threshold("--threshold", threshold)
        return cls(override=threshold, patterns=patterns)

    def overrides(self, name: str) -> bool:
        """Whether --threshold or a --tolerance sets `name`'s threshold: what the user allowed it, the
        relative difference alone judges (no scale check, scale.py)."""
        return self.override is not None or any(pattern.search(name) for pattern, _ in self.patterns)

    def for_tensor(self, kind: str, name: str, precision: str, shape: list[int]) -> float:
        """The threshold of a tensor of `shape`."""
        for pattern, value in reversed(self.patterns):
            if pattern.search(name):
                return value
        if self.override is not None:
            return self.override
        return sized(DEFAULTS, precision, kind, shape)
