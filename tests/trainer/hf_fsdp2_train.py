"""A user's Hugging Face training loop under torch's FSDP2, dumped with megalign.

    MEGALIGN_DUMP=dumps/w1 torchrun --nproc-per-node 1 hf_fsdp2_train.py
    MEGALIGN_DUMP=dumps/w2 torchrun --nproc-per-node 2 hf_fsdp2_train.py
    megalign compare dumps/w1 dumps/w2

A tiny LlamaForCausalLM from a random config, `fully_shard` on each decoder layer and on the root,
AdamW, two steps, each rank on its rows of the batch. The loss is the batch's mean over the tokens
its loss mask keeps: each rank sums its tokens' losses and divides by the whole batch's count
(transformers' num_items_in_batch), and FSDP2 sums the gradients over the ranks (divide factor 1).
`--bug rank-mean` plants the classic bug: each rank's own mean over its tokens (transformers'
default loss), averaged over the ranks. The loss mask is uneven, so the two differ.

`--pad N`: rows of 8, 5, 7 and 3 real tokens in step 0, 4, 8, 6 and 2 in step 1, right-padded to N
with an attention mask (as transformers' DataCollatorWithPadding(padding="max_length") gives them),
the padding's labels -100; the model is called as `model(ids, mask, labels=...)`.
`--bug pad-labels` plants the padding bug: the pad tokens keep their labels, so the loss and every
gradient depend on how far the rows were padded.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import megalign

parser = argparse.ArgumentParser()
parser.add_argument("--bug", choices=["rank-mean", "pad-labels"])
parser.add_argument("--pad", type=int, help="right-pad each step's rows (real tokens: LENGTHS) to this length")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,  # 67 rows: uneven shards
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                     attn_implementation="eager")
torch.manual_seed(0)
model = LlamaForCausalLM(config)
mesh = init_device_mesh("cpu", (world,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
for module in model.modules():
    if isinstance(module, FSDPModule):
        module.set_gradient_divide_factor(1.0)  # each rank's loss is its share of the batch's: sum
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

BATCH, SEQ, PAD_ID = 4, 8, 0
LENGTHS = [[8, 5, 7, 3], [4, 8, 6, 2]]  # the real tokens of each row under --pad, step by step


def batch(step):
    """This rank's rows of the step's batch, its attention mask, and the tokens the whole batch's
    loss mask keeps."""
    ids = torch.randint(1, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    labels = ids.clone()
    labels[BATCH // 2:, 2:] = -100  # uneven: the last rows are trained on their first tokens only
    mask = torch.ones_like(ids)
    if args.pad:
        mask = (torch.arange(args.pad) < torch.tensor(LENGTHS[step])[:, None]).long()
        ids = torch.nn.functional.pad(ids, (0, args.pad - SEQ)).masked_fill(mask == 0, PAD_ID)
        labels = torch.nn.functional.pad(labels, (0, args.pad - SEQ)).masked_fill(mask == 0, PAD_ID)
        if args.bug != "pad-labels":
            labels = labels.masked_fill(mask == 0, -100)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return ids[rows], mask[rows], labels[rows], (labels[:, 1:] != -100).sum()  # transformers shifts the labels


dumper = megalign.Dumper.from_env(params=True)
dumper.watch(model, batch_dim=0, seq_dim=1)  # every module's output by its HF name, the DTensor gradients
for step in range(2):
    ids, mask, labels, tokens = batch(step)
    with dumper.step(step):
        if args.bug == "rank-mean":
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss / world
        else:
            loss = model(ids, mask, labels=labels, num_items_in_batch=tokens).loss
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        dumper.add("loss", "loss", reported)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dumper.close()
dist.destroy_process_group()
