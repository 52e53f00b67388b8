"""Parameter gradients after backward, with a coverage check so that an empty dump cannot pass.

Under megatron's DDP the gradient lives in `param.main_grad` and `param.grad` is None: a dumper
that reads only `.grad` writes nothing. Reading `.grad` and falling back to `main_grad` is right
for both wrapped and bare models; `--grad-source grad` keeps the classic mistake reachable.
"""

from __future__ import annotations

from typing import Optional

import torch

from megalign.alignment.spec import RunSpec
from megalign.alignment.dump.writer import RankWriter
from megalign.alignment.dump.coverage import check_coverage, has_gradient
from megalign.alignment.stacks.megatron.model import (global_name, is_duplicate_embedding, layer_index, param_grad_layout,
                                      param_sharding)


def read_grad(param: torch.nn.Parameter, source: str) -> Optional[torch.Tensor]:
    if source == "grad":
        return param.grad
    if source == "main_grad":
        return getattr(param, "main_grad", None)
    return param.grad if param.grad is not None else getattr(param, "main_grad", None)


def collect_param_grads(model: torch.nn.Module, writer: RankWriter, spec: RunSpec) -> dict:
    """Dump every parameter's gradient; raise RunFailed naming the first parameters without one."""
    missing, present = [], 0
    for local, param in model.named_parameters():
        name = global_name(model, local)
        if is_duplicate_embedding(name, param):
            continue  # the first stage dumps the word embeddings' gradient after finalize's all-reduce
        grad = read_grad(param, spec.grad_source)
        if not has_gradient(grad):
            missing.append(name)
            continue
        present += 1
        grad, sharding = param_grad_layout(spec.model, name, grad, param_sharding(spec.model, name, param))
        writer.add("param_grad", name, grad, sharding, module=name.rsplit(".", 1)[0], layer=layer_index(name))
    return check_coverage(missing, len(missing) + present, spec.grad_source)
