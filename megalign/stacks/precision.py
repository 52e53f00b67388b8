"""`--dtype fp64`: the reference run, in float64 all the way through.

Both stacks narrow to float32 in places that assume a 16-bit run: transformers' RMSNorm and eager
softmax compute in float32, megatron-core's vocab-parallel cross entropy calls `.float()` on the
logits. In a float64 run those casts would put float32 rounding into the reference. `keep_float64`
is a torch function mode that turns every cast of a float64 tensor to float32 into a no-op, for
both stacks alike, so that neither library needs patching. Tensors made as float32 from integers
(the RoPE frequency tables of both stacks) stay float32: both stacks build them the same way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode


def _narrows(value, dtype) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float64 and dtype == torch.float32


class KeepFloat64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
        if func is torch.Tensor.float and _narrows(first, torch.float32):
            return first
        if func is torch.Tensor.to:
            if _narrows(first, kwargs.get("dtype")):
                kwargs["dtype"] = torch.float64
            args = tuple(torch.float64 if _narrows(first, a) else a for a in args)
        elif _narrows(first, kwargs.get("dtype")):  # softmax(x, dtype=torch.float32) and the like
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


@contextlib.contextmanager
def precision(dtype: str) -> Iterator[None]:
    """Run a stack's forward and backward under this for `dtype` ("fp64" keeps float64 throughout)."""
    if dtype != "fp64":
        yield
        return
    with KeepFloat64():
        yield
