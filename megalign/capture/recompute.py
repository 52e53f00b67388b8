"""Activation recomputation: a module's forward run a second time, inside backward, and recorded once.

Under megatron-core's recomputation (CheckpointFunction, CheckpointWithoutOutput) and torch's reentrant
checkpoint, the first forward of a checkpointed module runs under no_grad: its outputs are recorded
then, and carry no gradient. Backward runs the module again with grad enabled, and only those
recomputed outputs receive gradients: there the activation is not recorded again, but its gradient
is, in the place of the first call's record (TensorRecord.call), so that the names and their order
are those of a run without recomputation. Told apart without asking the framework (sglang's dumper
asks megatron's is_checkpointing, which CheckpointWithoutOutput never sets): a forward with grad
enabled while autograd runs a backward is a recomputation, whatever recomputed it. Torch's
non-reentrant checkpoint runs its first forward with grad enabled: those outputs get their
gradients themselves, and nothing waits for a recomputed call.
"""

from __future__ import annotations

from collections import deque

import torch


def recomputing() -> bool:
    """Whether the forward under way is a recomputation, run by backward."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


class AwaitingGradients:
    """The calls whose outputs were recorded under no_grad, name by name, in the order of their forward:
    backward recomputes them in that order (one micro-batch's forward, then its backward; 1F1B's
    first in, first out), and each recomputed output's gradient takes its call's place."""

    def __init__(self):
        self._calls: dict[str, deque[int]] = {}

    def wait(self, name: str, call: int) -> None:
        self._calls.setdefault(name, deque()).append(call)

    def recomputed(self, name: str) -> int | None:
        """The call `name`'s recomputed output stands for; None where none waits (torch's non-reentrant
        checkpoint: its first outputs carry their gradients themselves)."""
        calls = self._calls.get(name)
        return calls.popleft() if calls else None

    def clear(self) -> None:
        """A new step: calls of the last that were never recomputed (a no_grad evaluation) wait no longer."""
        self._calls.clear()
