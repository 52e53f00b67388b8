"""Importing megatron-core without torch's compiler, which a run does not use.

megatron-core's `jit_fuser` is torch.compile, and it decorates a dozen fusion functions when
megatron.core is imported: each decoration imports torch._dynamo and torch._inductor, about a third
of a rank's start-up, although the fusions are off in every run (model.transformer_config). While
megatron-core is imported, torch.compile is therefore one that compiles at the first call of what
it wraps: the same compiled function for the few that do run (the MoE router's), none for the rest.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch


@contextmanager
def compile_on_first_call():
    real = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real
