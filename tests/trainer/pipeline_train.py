"""A user's hand-written pipeline with data parallelism in each stage, dumped with megalign.

    MEGALIGN_DUMP=dumps/one torchrun --nproc-per-node 1 pipeline_train.py
    MEGALIGN_DUMP=dumps/pp2dp2 torchrun --nproc-per-node 4 pipeline_train.py
    megalign compare dumps/one dumps/pp2dp2

An MLP of four residual blocks. On 4 ranks, two stages of two data-parallel ranks: ranks 0 and 1 run
the input layer and blocks 0-1, ranks 2 and 3 blocks 2-3 and the head; each stage keeps the whole
model's module names (as torchtitan's pipeline split does: the other stage's blocks deleted), sends
its activations to the next stage's rank of the same DP rank and receives their gradients back, and
is wrapped in torch DDP over its own data-parallel group (a ("pp", "dp") DeviceMesh's "dp" dim). The
loss is the batch's mean: each rank sums its rows' squared errors and divides by the batch's row
count, all-reduced over its DP group, and DDP sums the gradients (a comm hook) instead of averaging
them. SGD, two steps.

The Dumper is given the DP group (`dp_group=mesh["dp"]`): without it, DDP's group of 2 of the 4
ranks is refused at watch(). `--bug world-count` plants a classic: the batch's row count all-reduced
over the whole world, stages included, so that the loss and every gradient are halved.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import megalign

parser = argparse.ArgumentParser()
parser.add_argument("--bug", choices=["world-count"])
parser.add_argument("--no-dp-group", action="store_true", help="the Dumper not told the DP group")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
stages = 1 if world == 1 else 2
dp = world // stages
mesh = init_device_mesh("cpu", (stages, dp), mesh_dim_names=("pp", "dp"))  # ranks 0, 1: stage 0
stage, dp_rank, dp_group = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), mesh["dp"].get_group()
first, last = stage == 0, stage == stages - 1

BLOCKS, WIDTH, BATCH = 4, 16, 8


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, WIDTH)
        self.blocks = torch.nn.ModuleDict({str(i): Block() for i in range(BLOCKS)})
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


torch.manual_seed(0)
net = Net()
per_stage = BLOCKS // stages
for i in range(BLOCKS):
    if i // per_stage != stage:
        del net.blocks[str(i)]
net.embed = net.embed if first else None
net.head = net.head if last else None


def allreduce_sum(group, bucket):
    """The gradients summed over the DP group: each rank's loss is its share of the batch's mean."""
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])


model = torch.nn.parallel.DistributedDataParallel(net, device_mesh=mesh["dp"])
model.register_comm_hook(dp_group, allreduce_sum)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

# The comm hook sums: said, since the Dumper cannot read a hook (unknown otherwise).
dumper = megalign.Dumper.from_env(params=True, dp_group=None if args.no_dp_group else mesh["dp"], grad_reduction="sum")
dumper.watch(model, batch_dim=0)
for step in range(2):
    data = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 4, generator=data), torch.randn(BATCH, 1, generator=data)
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    count = torch.tensor(float(BATCH // dp))
    dist.all_reduce(count, group=None if args.bug == "world-count" else dp_group)
    with dumper.step(step):
        if first:
            inputs = x[rows]
        else:
            inputs = torch.empty(BATCH // dp, WIDTH)
            dist.recv(inputs, src=rank - dp)
            inputs.requires_grad_()
        out = model(inputs)
        if last:
            loss = (out - y[rows]).square().sum() / count
            reported = loss.detach().clone()
            dist.all_reduce(reported, group=dp_group)
            dumper.add("loss", "loss", reported)
            loss.backward()
        else:
            dist.send(out.detach(), dst=rank + dp)
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + dp)
            out.backward(grad)
        if not first:
            dist.send(inputs.grad, dst=rank - dp)
    optimizer.step()
    optimizer.zero_grad()
dumper.close()
dist.destroy_process_group()
