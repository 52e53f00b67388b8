"""A user's loop under torch's tensor parallelism (`parallelize_module`), dumped with megalign.

    MEGALIGN_DUMP=dumps/tp1 torchrun --nproc-per-node 1 tp_train.py
    MEGALIGN_DUMP=dumps/tp2 torchrun --nproc-per-node 2 tp_train.py
    megalign compare dumps/tp1 dumps/tp2

Linear -> LayerNorm -> Linear: column-parallel, sequence-parallel, row-parallel. Its parameters and
their gradients are DTensors of every placement: Shard(0) and Shard(1) weights, a Replicate bias,
and the LayerNorm's gradients Partial(sum) (each rank's share of the tokens). SGD with gradient
clipping, two steps. `--bug local-norm` plants a classic: the clipping norm computed from each rank's
local gradients only.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import megalign

parser = argparse.ArgumentParser()
parser.add_argument("--bug", choices=["local-norm"])
parser.add_argument("--watch-outputs", action="store_true", help="watch the modules' outputs too (refused)")
args = parser.parse_args()

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
parallelize_module(model, mesh, {"0": ColwiseParallel(output_layouts=Shard(0)), "1": SequenceParallel(sequence_dim=0),
                                 "2": RowwiseParallel(input_layouts=Shard(0))})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

dumper = megalign.Dumper.from_env(params=True)
# The parameters and their gradients: DTensors, placed by their placements (outputs: refused).
dumper.watch(model, outputs=args.watch_outputs)
for step in range(2):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))  # every rank: the whole batch
    with dumper.step(step):
        loss = model(x).square().mean()
        dumper.add("loss", "loss", loss.detach())
        loss.backward()
    if args.bug == "local-norm":
        norm = torch.stack([p.grad.to_local().norm() for p in model.parameters()]).norm()
        for p in model.parameters():
            p.grad.mul_(min(1.0, 0.1 / float(norm)))
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    optimizer.step()
    optimizer.zero_grad()
dumper.close()
dist.destroy_process_group()
