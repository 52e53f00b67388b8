"""Parameter gradients after backward, with a coverage check so that an empty dump cannot pass.

Under megatron's DDP the gradient lives in `param.main_grad` and `param.grad` is None: a dumper
that reads only `.grad` writes nothing. Reading `.grad` and falling back to `main_grad` is right
for both wrapped and bare models; `--grad-source grad` keeps the classic mistake reachable.

With the distributed optimizer, DDP reduce-scatters each gradient bucket over the DP (x CP) ranks:
each rank holds the reduced values of its shard only, the rest of the buffer its own unreduced
gradients. The full gradients are the shards all-gathered, as `Dumper.step` gathers a user's
(capture/megatron_adapter.py: into fresh memory, the buckets left as they are); `--grad-source shard` reads
only the rank's own shard, the other classic mistake, and coverage then names the parameters that
lie outside it.
"""

from __future__ import annotations

import torch

from megalign.capture.coverage import check_coverage
from megalign.capture.ddp_grads import held_gradients
from megalign.capture.dumper import Dumper
from megalign.capture.megatron_adapter import param_grad_layout, param_sharding, read_grads
from megalign.capture.megatron_names import global_name, is_duplicate_embedding
from megalign.dump.format import Kind
from megalign.spec import RunSpec


def collect_param_grads(chunk: torch.nn.Module, model: torch.nn.Module, dumper: Dumper, spec: RunSpec) -> dict:
    """Dump every parameter's gradient, read as the Dumper reads a user's (megatron_adapter.read_grads,
    from `chunk`, the DDP-wrapped `model`) and held by the same rule; raise RunFailed naming the first
    parameters without one."""
    params = {}
    for local, param in model.named_parameters():
        name = global_name(model, local)
        if not is_duplicate_embedding(name, param):  # the first stage dumps the word embeddings' gradient
            params[name] = param
    grads = read_grads([chunk], params, spec.grad_source)
    vocab, padded = spec.model.vocab_size, spec.model.padded_vocab_size(spec.layout.tp)
    missing, present = [], 0
    for (name, grad), holds in zip(grads.items(), held_gradients(list(grads.values()), list(params.values()))):
        if not holds:
            missing.append(name)
            continue
        present += 1
        grad, sharding = param_grad_layout(name, grad, param_sharding(name, params[name], spec.model.swiglu),
                                           vocab, padded)
        dumper.add(Kind.PARAM_GRAD, name, grad, sharding, module=name.rsplit(".", 1)[0], stable=True)
    return check_coverage(missing, len(missing) + present, spec.grad_source)
