"""Gradient coverage: a backward run whose dump would miss a parameter's gradient fails, loudly.

Kept free of megatron imports so that the HF stack shares it without megatron's import cost.
"""

from __future__ import annotations

from typing import Optional

import torch

from megalign.errors import RunFailed


def read_grad(param: torch.nn.Parameter, source: str = "auto") -> Optional[torch.Tensor]:
    """`.grad`, falling back to megatron DDP's `main_grad` (where `.grad` stays None); `source` "grad"
    or "main_grad" reads only that one (--grad-source, which keeps the classic mistakes reachable)."""
    if source == "grad":
        return param.grad
    if source == "main_grad":
        return getattr(param, "main_grad", None)
    return param.grad if param.grad is not None else getattr(param, "main_grad", None)


def have_gradients(grads: list[Optional[torch.Tensor]]) -> list[bool]:
    """Whether each is a gradient: an all-zero one counts as missing (it is what an untouched DDP
    main_grad buffer holds). Read back at once: a read-back each stalls a GPU's queue at every
    parameter (12 ms a step of a 4-layer HF Llama on an H100, py-spy). count_nonzero is one pass
    that allocates nothing: `any(grad != 0)` took 3.4x as long on a CPU (a 4M-element gradient)."""
    present = [grad for grad in grads if grad is not None]
    if not present:
        return [False] * len(grads)
    device = present[0].device
    flags = iter(torch.stack([torch.count_nonzero(grad).to(device) for grad in present]).bool().tolist())
    return [grad is not None and next(flags) for grad in grads]


def check_coverage(missing: list[str], total: int, source: str) -> dict:
    """The manifest's grad_coverage record, or RunFailed naming the first parameters without a gradient."""
    if missing:
        raise RunFailed(f"{len(missing)} of {total} parameters have no gradient (read from {source}): "
                        f"{', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    return {"with_grad": total, "without_grad": 0}
