"""Which relative difference a tensor may have before it counts as diverged.

The threshold applies to the relative difference (metrics.py), for every kind. The defaults are
calibrated on a real trained model (SmolLM2-135M: transformers against megatron-core at CP=1, CP=2,
TP=3 and PP=2, fp32 and bf16, `bench/calibrate.py`): each is the largest difference seen there
times a margin, and each planted bug of the tests stays caught (docs/compare.md, "Verdicts on a real model").
Seen in fp32: activations, logits and logprobs up to 3e-12, the loss 1e-11, parameter gradients
4e-7 (the input norms of the last layers, where a "massive activation" channel reaches 22,000).
Seen in bf16: activations 1.7e-3, logits 3e-4, parameter gradients 0.04. Inputs must match exactly.
Precedence: a matching --tolerance pattern (the last one given wins), then --threshold, then the
per-kind default.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from megalign.dump.format import precision_name
from megalign.errors import UserError, compile_pattern

DEFAULTS: dict[str, dict[str, float]] = {
    "fp32": {"input": 0.0, "activation": 1e-8, "activation_grad": 1e-7, "param_grad": 1e-5, "param": 1e-5,
             "logits": 1e-8, "logprobs": 1e-8, "loss": 1e-9},
    "bf16": {"input": 0.0, "activation": 1e-2, "activation_grad": 2e-2, "param_grad": 1e-1, "param": 1e-1,
             "logits": 2e-3, "logprobs": 2e-3, "loss": 1e-5},
    # Both sides float64 (reference runs against each other): 1e-29 on one device, but up to 3e-19
    # between CUDA and the CPU, since megatron computes RoPE's cos and sin in float32 (measured on an H200).
    "fp64": {"input": 0.0, "activation": 1e-16, "activation_grad": 1e-16, "param_grad": 1e-16, "param": 1e-16,
             "logits": 1e-16, "logprobs": 1e-16, "loss": 1e-16},
}
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

    def for_tensor(self, kind: str, name: str, precision: str) -> float:
        for pattern, value in reversed(self.patterns):
            if pattern.search(name):
                return value
        if self.override is not None:
            return self.override
        defaults = DEFAULTS[precision]
        return defaults.get(kind, defaults["activation"])  # kinds of foreign dumps
