"""A user's megatron-core training loop, written with megatron-core's public API, dumped with megalign.

    MEGALIGN_DUMP=dumps/cp2 torchrun --nproc-per-node 2 megatron_train.py --cp 2
    MEGALIGN_DUMP=dumps/cp1 torchrun --nproc-per-node 2 megatron_train.py --cp 1
    megalign compare dumps/cp1 dumps/cp2

Its own GPTModel, DDP with the distributed optimizer, Adam, its own loss, three steps; steps 1 and 2
are dumped (parameter gradients, parameters, logits and the loss). `--bug local-tokens` plants the
classic CP bug: each rank's loss divided by its own token count.
"""

import argparse

# This machine has no GPU: megatron-core on the CPU (gloo) needs megalign's stand-ins, once, first.
from megalign.stacks.megatron.cpu_patches import apply_cpu_patches

apply_cpu_patches()

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

import megalign
from megalign.stacks.megatron.cp_attention import ZigzagCPAttention  # on a GPU: TE's attention spec

parser = argparse.ArgumentParser()
parser.add_argument("--cp", type=int, default=1)
parser.add_argument("--bug", choices=["local-tokens"])
args = parser.parse_args()

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(context_parallel_size=args.cp)
torch.manual_seed(1234)
tensor_parallel.model_parallel_cuda_manual_seed(1234)

VOCAB, SEQ, BATCH = 64, 16, 2
config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                           context_parallel_size=args.cp, use_cpu_initialization=True,
                           hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True,
                           bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
                           bias_dropout_fusion=False, gradient_accumulation_fusion=False)
spec = get_gpt_layer_local_spec()
spec.submodules.self_attention.submodules.core_attention = ZigzagCPAttention
model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                 position_embedding_type="rope")
ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0,
                                                   use_distributed_optimizer=True), [ddp])

dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()


def batch(step):
    """The whole batch of the step, this DP rank's rows, then this CP rank's zigzag share of them."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[1, 3:] = 0  # uneven: the second row's loss is on 3 tokens only
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    whole = {"tokens": tokens[rows, :-1], "labels": tokens[rows, 1:], "loss_mask": loss_mask[rows],
             "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)[rows], "cu_seqlens": None}
    cp_group = parallel_state.get_context_parallel_group()
    return get_batch_on_this_cp_rank(whole, is_hybrid_cp=False, cp_group=cp_group), loss_mask.sum()


dumper = megalign.Dumper.from_env(steps=[1, 2], params=True)
dumper.watch(ddp, outputs=False)  # parameter gradients where DDP leaves them, and the parameters
for step in range(3):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    mine, total_tokens = batch(step)
    with dumper.step(step):
        logits = ddp(mine["tokens"], mine["position_ids"], attention_mask=None)  # [b, s, vocab]
        dumper.add("logits", "logits", logits, megalign.Sharding(dp_dim=0, seq_dim=1))
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), mine["labels"], reduction="none")
        summed = (per_token * mine["loss_mask"]).sum()
        count = mine["loss_mask"].sum() if args.bug == "local-tokens" else total_tokens
        loss = summed / count * dist.get_world_size(dp_cp)  # DDP averages the gradients over DP x CP
        loss.backward()
        finalize_model_grads([ddp])
        reported = loss.detach() / dist.get_world_size(dp_cp)
        dist.all_reduce(reported, group=dp_cp)
        dumper.add("loss", "loss", reported)
    optimizer.step()
dumper.close()
dist.destroy_process_group()
