"""Parameter gradients where megatron-core's DDP leaves them, read without touching the user's buffers.

After `finalize_model_grads`, `.grad` is None and each `param.main_grad` is a view into its bucket's
`grad_data`. With the distributed optimizer only this rank's 1/(DP*CP) shard of each bucket holds
reduced values; the rest holds the rank's own unreduced gradient. The full gradient is each
rank's shard, all-gathered into a fresh tensor (never into `grad_data`: the user's code after the
step, clipping included, must see the buffer as DDP left it). Read through megatron_adapter.read_grads
by the Dumper and megalign's megatron worker alike, which decide whether a rank holds one by
held_gradients. Duck-typed, so that the Dumper imports no megatron.
"""

from __future__ import annotations

import gc
import sys
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megalign.capture.coverage import have_gradients


def megatron_state() -> Optional[object]:
    """megatron-core's parallel_state where the program initialised it, else None (read where the
    program imported it: the Dumper imports no megatron)."""
    state = sys.modules.get("megatron.core.parallel_state")
    return state if state is not None and state.model_parallel_is_initialized() else None


def held_gradients(grads: list[Optional[torch.Tensor]], params: list[torch.nn.Parameter]) -> list[bool]:
    """Whether this rank holds each of `grads`, the gradients of `params`: the rule of megalign's
    megatron worker and of the Dumper alike. Nonzero on some rank of the parameter's megatron TP group
    (tp_group): a vocabulary-parallel embedding's shard is all zeros where no token of the batch falls
    in its rows, and is a gradient all the same. An expert's is decided over the expert TP ranks, whose
    EP rank (its experts) is this rank's: over the TP ranks, expert 0's gradient on one rank would
    vouch for expert 2's on the next. Every rank of a group calls it with the same parameters in the
    same order (megatron gives every TP rank the same ones, and every expert TP rank the same
    experts); without megatron's TP, each rank decides alone (coverage.have_gradients)."""
    held = [False] * len(grads)
    for expert in (False, True):  # one collective each, in one order on every rank
        where = [index for index, param in enumerate(params) if is_expert(param) == expert]
        group = tp_group(params[where[0]]) if where else None
        for index, holds in zip(where, have_gradients([grads[index] for index in where], group)):
            held[index] = holds
    return held


def is_expert(param: torch.nn.Parameter) -> bool:
    """megatron-core marks an expert's parameters `allreduce` False: DDP reduces their gradients over
    the expert-data-parallel ranks (those holding the same experts), not the DP ranks."""
    return getattr(param, "allreduce", True) is False


def tp_group(param: torch.nn.Parameter) -> Optional[dist.ProcessGroup]:
    """The ranks that split a megatron-core parameter under tensor parallelism: an expert's over the
    expert TP ranks (ETP, which need not be TP), any other's over the TP ranks; None where none do."""
    state = megatron_state()
    if state is None:
        return None
    if is_expert(param):
        size, group = state.get_expert_tensor_parallel_world_size(), state.get_expert_tensor_parallel_group
    else:
        size, group = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_group
    return group() if size > 1 else None


def is_megatron_ddp(module: object) -> bool:
    return hasattr(module, "bucket_groups") and hasattr(module, "ddp_config") and hasattr(module, "module")


def find_megatron_ddp(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The megatron DDP wrapping `module`, when the user watched the bare model: a one-time scan,
    done only where a parameter has a `main_grad` (which only such a DDP gives it)."""
    if not any(hasattr(param, "main_grad") for param in module.parameters()):
        return None
    return next((o for o in gc.get_objects() if is_megatron_ddp(o) and o.module is module), None)


def sharded(ddp: torch.nn.Module) -> bool:
    """Whether the distributed optimizer leaves only a shard of each bucket reduced (plain DDP
    all-reduces whole buckets: main_grad is then the gradient)."""
    return bool(ddp.ddp_config.use_distributed_optimizer)


def _shards(ddp: torch.nn.Module) -> Iterator[tuple[object, object, slice]]:
    """(bucket, its distributed-optimizer group, this rank's shard of its grad_data) of every bucket."""
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        ranks = group.intra_distributed_optimizer_instance_group
        for bucket in group.buckets:
            size = bucket.grad_data.numel() // ranks.size()  # megatron pads buckets to a multiple of the group size
            yield bucket, ranks, slice(ranks.rank() * size, (ranks.rank() + 1) * size)


def gathered_grads(ddp: torch.nn.Module) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(param, full reduced gradient) for every parameter of a sharded DDP, one bucket at a time
    (the gathered bucket is the only extra memory). Every rank of the DP*CP group must call it."""
    for bucket, ranks, mine in _shards(ddp):
        full = torch.empty_like(bucket.grad_data)
        dist.all_gather_into_tensor(full, bucket.grad_data[mine].contiguous(), group=ranks)
        for param, (start, end) in bucket.param_to_index.items():
            yield param, full[start:end].view(param.shape)


def shard_grads(ddp: torch.nn.Module) -> Iterator[tuple[torch.nn.Parameter, Optional[torch.Tensor]]]:
    """(param, its `main_grad` where it lies wholly in this rank's shard of its bucket, else None) for
    every parameter: what reading the shard alone gives (megalign's `--grad-source shard`, a classic
    mistake)."""
    for bucket, _, mine in _shards(ddp):
        for param, (start, end) in bucket.param_to_index.items():
            yield param, param.main_grad if mine.start <= start and end <= mine.stop else None
