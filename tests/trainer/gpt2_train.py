"""A user's GPT-2 training loop under torch's DDP or FSDP2, each at its defaults, dumped with megalign.

    MEGALIGN_DUMP=dumps/w1 torchrun --nproc-per-node 1 gpt2_train.py --wrap ddp
    MEGALIGN_DUMP=dumps/w2 torchrun --nproc-per-node 2 gpt2_train.py --wrap ddp
    megalign compare dumps/w1 dumps/w2

A model family megalign maps nothing of: transformers' GPT2LMHeadModel from a tiny random config
(Conv1D layers, a learned position embedding whose output, [1, seq, d], every row shares), dropout
off. DDP and FSDP2 average the gradients over the ranks, so the loss that trains on the whole batch
is each rank's token-loss sum over the whole batch's token count, times the world size. AdamW,
clip_grad_norm_, three steps; rows right-padded with uneven lengths, and an uneven loss mask.

Planted bugs, each a classic: `rank-mean`, each rank's own mean over its tokens; `unscaled`, the
sum over the global count without the world size (every gradient divided by it); `same-shard`,
every rank on the first rank's rows; `local-clip` (FSDP2), the clipping norm of the rank's own
shard of the gradients; `dropout`, GPT2Config's dropout left on (at world 1 as well: each rank draws
the first rank's masks). `--clip inside` clips inside the dumper's step block, `after` after it.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

import megalign

parser = argparse.ArgumentParser()
parser.add_argument("--wrap", choices=["ddp", "fsdp2"], required=True)
parser.add_argument("--clip", choices=["inside", "after"], default="after")
parser.add_argument("--bug", choices=["rank-mean", "unscaled", "same-shard", "local-clip", "dropout"])
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dropout = {} if args.bug == "dropout" else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
config = GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                    **dropout)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)
if args.wrap == "ddp":
    model = DistributedDataParallel(model)
else:
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

BATCH, SEQ, MAX_NORM = 4, 8, 0.5
LENGTHS = [[8, 5, 7, 3], [4, 8, 6, 2], [6, 3, 8, 5]]  # each step's rows' real tokens


def batch(step):
    """This rank's rows of the step's batch: tokens, attention mask, labels (-100: not trained on)."""
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    mask = (torch.arange(SEQ) < torch.tensor(LENGTHS[step])[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[BATCH // 2:, 4:] = -100  # the loss mask: the last rows are trained on their first tokens only
    share = 0 if args.bug == "same-shard" else rank
    rows = slice(share * BATCH // world, (share + 1) * BATCH // world)
    return ids[rows], mask[rows], labels[rows]


def clip():
    if args.bug == "local-clip":
        norm = torch.stack([p.grad.to_local().norm() for p in model.parameters()]).norm()
        for p in model.parameters():
            p.grad.mul_(min(1.0, MAX_NORM / (float(norm) + 1e-6)))
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


dumper = megalign.Dumper.from_env(params=True)
dumper.watch(model, batch_dim=0, seq_dim=1)
for step in range(3):
    ids, mask, labels = batch(step)
    with dumper.step(step):
        logits = model(input_ids=ids, attention_mask=mask).logits
        summed = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
        tokens = (labels[:, 1:] != -100).sum()
        if args.bug == "rank-mean":
            loss = summed / tokens
        else:
            dist.all_reduce(tokens)  # the whole batch's
            loss = summed / tokens * (1 if args.bug == "unscaled" else world)
        dumper.add("loss", "loss", loss.detach(), megalign.Sharding(partial="mean"))  # DDP averages: so does the loss
        loss.backward()
        if args.clip == "inside":
            clip()
    if args.clip == "after":
        clip()
    optimizer.step()
    optimizer.zero_grad()
dumper.close()
dist.destroy_process_group()
