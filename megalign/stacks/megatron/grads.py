"""Parameter gradients after backward, with a coverage check so that an empty dump cannot pass.

Under megatron's DDP the gradient lives in `param.main_grad` and `param.grad` is None: a dumper
that reads only `.grad` writes nothing. Reading `.grad` and falling back to `main_grad` is right
for both wrapped and bare models; `--grad-source grad` keeps the classic mistake reachable.

With the distributed optimizer, DDP reduce-scatters each gradient bucket over the DP (x CP) ranks:
each rank holds the reduced values of its shard only, the rest of the buffer its own unreduced
gradients. The full gradients are the shards all-gathered, as `Dumper.step` gathers a user's
(dump/ddp_grads.py: into fresh memory, the buckets left as they are); `--grad-source shard` reads
only the rank's own shard, the other classic mistake, and coverage then names the parameters that
lie outside it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megalign.dump.coverage import check_coverage, have_gradients, read_grad
from megalign.dump.ddp_grads import gathered_grads, shard_grads
from megalign.dump.dumper import Dumper
from megalign.spec import RunSpec
from megalign.stacks.megatron.model import global_name, is_duplicate_embedding, param_grad_layout, param_sharding


def _nonzero_in_tp_group(grads: dict) -> list[bool]:
    """Whether each gradient is nonzero on some rank of the TP group: a vocabulary-parallel embedding's
    shard is all zeros where no token of the batch falls in its rows, and is a gradient all the same.
    (Every TP rank holds the same parameters in the same order.)"""
    flags = torch.tensor(have_gradients(list(grads.values())), dtype=torch.uint8)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return [bool(flag) for flag in flags]


def collect_param_grads(chunk: torch.nn.Module, model: torch.nn.Module, dumper: Dumper, spec: RunSpec) -> dict:
    """Dump every parameter's gradient; raise RunFailed naming the first parameters without one.
    `chunk` is the DDP-wrapped `model`."""
    held = None  # param -> its gradient, where the distributed optimizer leaves a shard of each bucket
    if spec.distributed_optimizer and spec.grad_source != "grad":  # `.grad`: None under DDP, the classic mistake
        held = shard_grads(chunk) if spec.grad_source == "shard" else dict(gathered_grads(chunk))
    params, grads = {}, {}
    for local, param in model.named_parameters():
        name = global_name(model, local)
        if not is_duplicate_embedding(name, param):  # the first stage dumps the word embeddings' gradient
            params[name] = param
            grads[name] = held.get(param) if held is not None else read_grad(param, spec.grad_source)
    nonzero = _nonzero_in_tp_group(grads)
    missing, present = [], 0
    for (name, grad), anywhere in zip(grads.items(), nonzero):
        param = params[name]
        if grad is None or not anywhere:
            missing.append(name)
            continue
        present += 1
        grad, sharding = param_grad_layout(spec.model, name, grad, param_sharding(spec.model, name, param))
        dumper.add("param_grad", name, grad, sharding, module=name.rsplit(".", 1)[0], stable=True)
    return check_coverage(missing, len(missing) + present, spec.grad_source)
