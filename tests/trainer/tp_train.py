"""A user's loop under torch's tensor parallelism (`parallelize_module`), dumped with megalign.

    MEGALIGN_DUMP=dumps/tp1 torchrun --nproc-per-node 1 tp_train.py
    MEGALIGN_DUMP=dumps/tp2 torchrun --nproc-per-node 2 tp_train.py
    megalign compare dumps/tp1 dumps/tp2

Written from torch's tensor parallel docs, at their defaults: a 1-D DeviceMesh over the world,
GPT-2's own MLP (transformers' GPT2MLP) column- then row-parallel (`ColwiseParallel()`,
`RowwiseParallel()`), between an input projection, a LayerNorm and a head left as they are. Two of
torch's traps, each met with the user's workaround: the styles take nn.Linear only, so GPT-2's
Conv1D layers become Linears first; clip_grad_norm_ refuses a mix of DTensor and plain gradients,
so the clip is written out. AdamW, three steps, every rank on the whole batch.

`--bug local-norm` plants a classic: the clipping norm computed from each rank's local shards only.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

import megalign

parser = argparse.ArgumentParser()
parser.add_argument("--bug", choices=["local-norm"])
args = parser.parse_args()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = GPT2MLP(32, GPT2Config(n_embd=8, resid_pdrop=0.0))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.mlp(self.norm(self.embed(x))))


def as_linear(conv):
    """GPT-2's Conv1D (weight [in, out]) as the nn.Linear ColwiseParallel and RowwiseParallel take."""
    linear = torch.nn.Linear(*conv.weight.shape)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    return linear


def clip_grad_norm(params, max_norm):
    """clip_grad_norm_ for a mix of DTensor and plain gradients: a DTensor's norm made whole first."""
    norms = [p.grad.norm() for p in params]
    if args.bug == "local-norm":
        norms = [p.grad.to_local().norm() if isinstance(p.grad, DTensor) else p.grad.norm() for p in params]
    norm = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    for p in params:
        p.grad.mul_(min(1.0, max_norm / (float(norm) + 1e-6)))


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = Net()
model.mlp.c_fc, model.mlp.c_proj = as_linear(model.mlp.c_fc), as_linear(model.mlp.c_proj)
parallelize_module(model, mesh, {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

dumper = megalign.Dumper.from_env(params=True)
dumper.watch(model)
for step in range(3):
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(step))  # every rank: the whole batch
    with dumper.step(step):
        loss = model(x).square().mean()
        dumper.add("loss", "loss", loss.detach())
        loss.backward()
        clip_grad_norm(list(model.parameters()), 0.1)
    optimizer.step()
    optimizer.zero_grad()
dumper.close()
dist.destroy_process_group()
