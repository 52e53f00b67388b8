"""A step's parameter gradients read where a clip cannot hide in them: once the gradient reduction
completes (the step's param_grad), and again as the optimizer steps on them, kept only where they
differ (`param_grad <name>#stepped`: a clip, or anything else done to them in between).

Read at the end of `step()` alone, a clip placed after the step block was never seen: a clip by the
local shard's norm showed at the next step's parameters only. Read at the reduction alone, a clip
inside the block and one after it read alike, but neither clip is seen. So both: the reduced values
line up between runs wherever each clips, and the values the optimizer steps on show the clip at its
own step.

When the reduction completes: torch DDP's reducer waits for its all-reduce in a final callback of
the autograd engine, queued during backward when its last bucket is ready; FSDP2 waits for its
reduce-scatter in `_root_post_backward_final_callback`, queued from the pre-backward hook on its
root's outputs (torch 2.13, _fsdp_state.py). The engine runs the final callbacks in the order
queued, and one queued by a running callback after every other: ours is queued from a hook on the
watched model's outputs during backward, and queues the read when it runs. A one-rank model's
gradients are final at the same point. Elsewhere the reduction is the loop's own (an all_reduce of
`.grad` after backward): the gradients are read at the end of the step block, as before, and so are
megatron-core DDP's, which reduces in finalize_model_grads; both are read again as the optimizer steps.

As the optimizer steps on them: torch.optim's global step pre-hook, the first after the step block
(an optimizer stepped inside the block steps on what the block's end reads). megatron-core's
optimizers step a torch optimizer inside theirs, after their own clip: a clip of main_grad the loop
writes after the block is seen there, at its own step. A loop without a torch optimizer is read at
the block's end.

Compared: a fingerprint of every gradient this rank holds (its sum and norm in float64; a scale
other than 1 moves both). Where the rank's gradients changed, every one is written again; the
same loop on the other side writes them too, and a run that clips where the other does not fails at
the first (compare fails a tensor on one side only).

On a device, stats-only, nothing waits for the device to compare (a read-back a read stalled the
step's queue): the fingerprints are compared on the device, and each `#stepped` read is written
tentatively, kept only if a device flag, its "they changed and differ from the reduced ones", is
still true when the writer closes (later reads clear an earlier one's flag where the gradients
changed again). The statistics kernel reads the flag first and skips a read that is not kept, so an
unchanged step costs a launch a gradient. Elsewhere the comparison is read back at once: on a CPU it
costs nothing, and a full dump would copy every gradient it then throws away.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megalign.capture.coverage import collective_device
from megalign.capture.dtensor import is_dtensor
from megalign.dump.format import STEPPED


class GradReads:
    """The reads of one Dumper. `record(suffix)` writes every watched gradient held (param_grad,
    named with `suffix`) and returns the orders written; `grads()` gives them; `discard(orders)`
    leaves records out; `live()`: whether the current step is written; `in_backward()`: whether the
    gradients are reduced by the end of backward (a watched torch DDP or FSDP2, or one DP rank);
    `deferred(fingerprint)`: whether comparisons of that fingerprint are left where it lies (stats-only
    on a device), the records written meanwhile kept where `kept_if(flag)`'s flag is true at close."""

    def __init__(self, record: Callable[[str], range], grads: Callable[[], list[torch.Tensor]],
                 discard: Callable[[range], None], live: Callable[[], bool], in_backward: Callable[[], bool],
                 deferred: Callable[[torch.Tensor], bool], kept_if: Callable[[torch.Tensor], ContextManager]):
        self._record, self._grads, self._discard, self._live = record, grads, discard, live
        self._in_backward, self._deferred, self._kept_if = in_backward, deferred, kept_if
        self._handles: list = []
        self._queued = False
        self.awaiting = False  # a written step ended whose optimizer has not stepped yet
        self._together = False  # a model whose gradients the ranks read together is watched (_anywhere)
        self._begin()

    def _begin(self) -> None:
        self._reduced: Optional[tuple[range, torch.Tensor]] = None
        self._stepped: Optional[tuple[range, torch.Tensor]] = None
        # Deferred: the fingerprint last written (a flag's choice between two) and the step's #stepped
        # reads' flags, each still true while its read is the one kept.
        self._last: Optional[torch.Tensor] = None
        self._flags: list[torch.Tensor] = []

    @property
    def watching(self) -> bool:
        """Whether a model is watched: its gradients are read by these reads, not at the block's end alone."""
        return bool(self._handles)

    def watch(self, module: torch.nn.Module, on_optimizer: Callable[[], None], outputs: bool = True) -> None:
        """`on_optimizer()` before any torch optimizer steps; with `outputs`, a read after every
        backward through `module`'s outputs (megatron-core's DDP reduces in finalize_model_grads,
        inside the step block: its gradients are read at the block's end)."""
        if not self._handles:
            self._handles.append(register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: on_optimizer()))
        if outputs:
            self._handles.append(module.register_forward_hook(self._on_outputs))
        else:
            self._together = True

    def begin_step(self) -> None:
        self._begin()
        self._queued = self.awaiting = False  # a backward that raised ran no final callback

    def end_step(self) -> None:
        """The step block ended: the reduced gradients where backward did not read them, else what
        the optimizer would step on now; then awaiting the optimizer's step."""
        if self._reduced is None:
            self._reduced = (self._record(""), _fingerprint(self._grads()))
        else:
            self.stepped()
        self.awaiting = True

    def stepped(self) -> None:
        """The gradients as they are now, written where they differ from the last written."""
        now = _fingerprint(self._grads())
        if self._deferred(now):
            self._stepped_later(now)
            return
        last = (self._stepped or self._reduced)[1]
        if not self._anywhere(not _same(now, last)):
            return
        if self._stepped is not None:
            self._discard(self._stepped[0])
        self._stepped = (self._record(STEPPED), now) if self._anywhere(not _same(now, self._reduced[1])) else None

    def _stepped_later(self, now: torch.Tensor) -> None:
        """stepped(), decided on the device: written now, kept if the flag stays true."""
        last = self._reduced[1] if self._last is None else self._last
        changed = self._anywhere_on_device(_differ(now, last))
        for flag in self._flags:
            flag.logical_and_(~changed)
        flag = changed & self._anywhere_on_device(_differ(now, self._reduced[1]))
        with self._kept_if(flag):
            self._record(STEPPED)
        self._flags.append(flag)
        self._last = now if now.shape != last.shape else torch.where(changed, now, last)

    def _anywhere_on_device(self, differ: torch.Tensor) -> torch.Tensor:
        """_anywhere, the flag left on the device (NCCL's all_reduce is queued, not waited for)."""
        if not self._together or not dist.is_initialized() or dist.get_world_size() == 1:
            return differ
        flag = differ.to(collective_device(), torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.to(differ.device, torch.bool)

    def _anywhere(self, differ: bool) -> bool:
        """Whether the gradients differ on this rank, or, where the ranks read them together (a
        megatron model's TP ranks decide each gradient's presence over their group), on any rank:
        a clip by each rank's own shard changes one rank's and not another's."""
        if not self._together or not dist.is_initialized() or dist.get_world_size() == 1:
            return differ
        flag = torch.tensor([int(differ)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_outputs(self, module, inputs, output) -> None:
        if self._live() and self._in_backward():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._queue)

    def _queue(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(lambda: Variable._execution_engine.queue_callback(self._read))

    def _read(self) -> None:
        """After the reductions' callbacks: the step's param_grad. A later backward of the step
        (accumulation) replaces an earlier one's."""
        self._queued = False
        if not self._live():
            return
        for earlier in filter(None, (self._reduced, self._stepped)):
            self._discard(earlier[0])
        for flag in self._flags:  # tentative #stepped reads of an earlier backward
            flag.zero_()
        self._stepped, self._last, self._flags = None, None, []
        self._reduced = (self._record(""), _fingerprint(self._grads()))


def _tensors(output) -> list[torch.Tensor]:
    """The tensors of a module's output: itself, or a tuple's, list's or dict's (a ModelOutput's)."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for t in values if isinstance(t, torch.Tensor)]


def _fingerprint(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient's sum, then each one's 2-norm, taken in float64 as the values are read. A float64 copy and
    its square, three reads a step, moved 44 bytes a float32 element each: 17 GB a step of
    bench_trainer's hidden-1024 model (129M gradients), about 5 ms of its 36 ms on an H100 by
    arithmetic, where these two reductions read 8."""
    local = [(g.to_local() if is_dtensor(g) else g).detach() for g in grads]
    if not local:
        return torch.zeros(0, dtype=torch.float64)
    # The norms by one multi-tensor kernel on a device: a kernel a gradient each, the sums and norms of
    # three reads a step were 2 x 39 x 3 = 234 launches a step of bench_trainer's 4-layer Llama, now
    # 120 (torch has no multi-tensor sum).
    norms = torch._foreach_norm(local, 2, dtype=torch.float64)
    return torch.stack([s.to(local[0].device) for s in (*(g.sum(dtype=torch.float64) for g in local), *norms)])


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether fingerprints differ, as a bool on a's device (NaN equal to NaN), without waiting for it."""
    if a.shape != b.shape:
        return torch.ones((), dtype=torch.bool, device=a.device)
    b = b.to(a.device)
    return ~((a == b) | (a.isnan() & b.isnan())).all()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b.to(a.device), rtol=0, atol=0, equal_nan=True)
