"""Parameter gradients after backward, with a coverage check so that an empty dump cannot pass.

Under megatron's DDP the gradient lives in `param.main_grad` and `param.grad` is None: a dumper
that reads only `.grad` writes nothing. Reading `.grad` and falling back to `main_grad` is right
for both wrapped and bare models; `--grad-source grad` keeps the classic mistake reachable.

With the distributed optimizer, DDP reduce-scatters each gradient bucket over the DP (x CP) ranks:
each rank holds the reduced values of its shard only, the rest of the buffer its own unreduced
gradients. The full gradients are the shards all-gathered, as `Dumper.step` gathers a user's
(capture/ddp_grads.py: into fresh memory, the buckets left as they are); `--grad-source shard` reads
only the rank's own shard, the other classic mistake, and coverage then names the parameters that
lie outside it.
"""

from __future__ import annotations

import torch

from megalign.capture.coverage import check_coverage, read_grad
from megalign.capture.ddp_grads import gathered_grads, held_gradients, shard_grads
from megalign.capture.dumper import Dumper
from megalign.capture.megatron_names import global_name, is_duplicate_embedding
from megalign.spec import RunSpec
from megalign.stacks.megatron.model import param_grad_layout, param_sharding


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
    missing, present = [], 0
    for (name, grad), holds in zip(grads.items(), held_gradients(list(grads.values()), list(params.values()))):
        if not holds:
            missing.append(name)
            continue
        present += 1
        grad, sharding = param_grad_layout(spec.model, name, grad, param_sharding(spec.model, name, params[name]))
        dumper.add("param_grad", name, grad, sharding, module=name.rsplit(".", 1)[0], stable=True)
    return check_coverage(missing, len(missing) + present, spec.grad_source)
