"""A user's megatron-core training loop, written with megatron-core's public API, dumped with megalign.

    MEGALIGN_DUMP=dumps/cp2 torchrun --nproc-per-node 2 megatron_train.py --cp 2
    MEGALIGN_DUMP=dumps/cp1 torchrun --nproc-per-node 2 megatron_train.py --cp 1
    megalign compare dumps/cp1 dumps/cp2

Its own GPTModel, DDP with the distributed optimizer, Adam, its own loss, three steps; steps 1 and 2
are dumped (every module's output and its gradient, parameter gradients, parameters, logits and the
loss), with nothing declared but the logits' sharding. `--tp 2 --sp`: tensor and sequence
parallelism. `--clip MAX`: the script's own gradient clipping by the global norm, in place of the
optimizer's (with plain DDP: the clip reads every main_grad whole). `--packed`: four documents of
uneven lengths, this DP rank's share packed into one row (THD, PackedSeqParams), split over CP ranks
document by document. `--half-vocab`: token ids from the lower half of the vocabulary only (at TP=2,
no token reaches TP rank 1's rows of the embedding: their gradient is all zero). Planted bugs:
`--bug local-tokens`, the classic CP bug (each rank's loss divided by its own token count);
`--bug local-clip`, the clip's norm computed on the rank's own shard only; `--bug row-split` (with
--packed), the row split over CP ranks as one sequence while the attention is told the documents;
`--bug zero-embedding-grad`, TP rank 0's shard of the embedding's gradient zeroed after the reduction.

`--pp N`: N pipeline stages, the step run by megatron-core's pipeline schedule
(get_forward_backward_func), the logits and the loss on the last stage. `--draw-weights`: each
weight matrix drawn whole from its global name (a layer's `layer_number` is global, its index on the
stage is not), each TP rank taking its slice, so that any number of stages and TP ranks start from
the same model (megatron's own initialisation draws each stage's weights from where the seed stands
when the stage builds them). Planted bug: `--bug local-names`, the weights drawn from each stage's
own names (`decoder.layers.0` on every stage), a classic of loading a checkpoint stage by stage.
`--stats-only`: the dump holds each tensor's statistics, not its values.

`--loss megatron`: megatron's own loss convention, as its pretrain_gpt writes it: the loss function
returns the rank's token-loss sum and its token count, and megatron's schedule
(get_forward_backward_func) divides: with calculate_per_token_loss, finalize_model_grads divides the
summed gradients by the whole batch's count (the Dumper records each step's). DDP at its defaults.
Planted bug: `--bug cp-local-mean`, calculate_per_token_loss left at megatron's default, off: the
schedule divides each rank's sum by its own count and DDP averages over DP x CP, the classic CP bug
where the CP ranks hold uneven shares of the loss mask.

`--recompute`: megatron's full activation recomputation, one layer a unit (recompute_granularity full,
recompute_method uniform), as a run too big for its activations trains: each layer's forward runs
again in backward, and the dump must hold what a run without it holds.

`--moe`: a mixture of experts in every layer (megatron-core's MoE layer spec: 4 experts, top-2, no
load-balancing loss), `--ep N` splitting them over N expert-parallel ranks (each holds 4/N experts,
`local_experts.0` on every rank), `--etp M` over M expert TP ranks (megatron's default: TP; under TP,
MoE needs `--sp`); with --draw-weights each expert is drawn whole from its global index.
`--expert-bias`: DeepSeek-V3's router (sigmoid scores, the aux-loss-free expert bias that megatron's
finalize_model_grads moves after every step, at megatron's default moe_router_bias_update_rate).
Planted bug: `--bug local-experts`, the experts drawn from each EP rank's own indices (expert 2
drawn as expert 0 on EP rank 1), the expert twin of local-names.
"""

import argparse
import re
import zlib
from functools import partial

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
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

import megalign
from megalign.stacks.megatron.cp_attention import ZigzagCPAttention  # on a GPU: TE's attention spec
from megalign.stacks.megatron.norm import SequenceParallelNorm  # on a GPU: TE's norm, which marks its weights for SP

parser = argparse.ArgumentParser()
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--sp", action="store_true")
parser.add_argument("--cp", type=int, default=1)
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--moe", action="store_true")
parser.add_argument("--expert-bias", action="store_true")
parser.add_argument("--ep", type=int, default=1)
parser.add_argument("--etp", type=int)
parser.add_argument("--draw-weights", action="store_true")
parser.add_argument("--stats-only", action="store_true")
parser.add_argument("--clip", type=float)
parser.add_argument("--packed", action="store_true")
parser.add_argument("--half-vocab", action="store_true")
parser.add_argument("--recompute", action="store_true")
parser.add_argument("--loss", choices=["own", "megatron"], default="own")
parser.add_argument("--bug", choices=["local-tokens", "local-clip", "row-split", "zero-embedding-grad",
                                      "local-names", "local-experts", "cp-local-mean"])
args = parser.parse_args()

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, context_parallel_size=args.cp,
                                         pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep,
                                         expert_tensor_parallel_size=args.etp)
torch.manual_seed(1234)
tensor_parallel.model_parallel_cuda_manual_seed(1234)

VOCAB, SEQ, BATCH, LAYERS, EXPERTS = 64, 16, 2, 2, 4
moe = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=48, moe_router_load_balancing_type="none",
           expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp) if args.moe else {}
recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
    if args.recompute else {}
if args.expert_bias:  # DeepSeek-V3's router, its bias moved by finalize_model_grads at megatron's default rate
    moe.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
config = TransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, add_bias_linear=False,
                           tensor_model_parallel_size=args.tp, sequence_parallel=args.sp,
                           context_parallel_size=args.cp, pipeline_model_parallel_size=args.pp,
                           pipeline_dtype=torch.float32, use_cpu_initialization=True,
                           hidden_dropout=0.0, attention_dropout=0.0,
                           calculate_per_token_loss=args.bug != "cp-local-mean",
                           bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
                           bias_dropout_fusion=False, gradient_accumulation_fusion=False, **moe, **recompute)
layer = get_gpt_layer_local_spec(num_experts=EXPERTS if args.moe else None, moe_grouped_gemm=False)
layer.submodules.self_attention.submodules.core_attention = ZigzagCPAttention
layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
spec = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),  # this stage's layers
                                  layer_norm=SequenceParallelNorm)
model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                 position_embedding_type="rope", pre_process=parallel_state.is_pipeline_first_stage(),
                 post_process=parallel_state.is_pipeline_last_stage())


def draw_weights():
    """--draw-weights: every weight matrix drawn whole from its global name, this TP rank's slice of it
    kept (norms keep their ones and zeros)."""
    def global_layer(match):
        return f"decoder.layers.{model.decoder.layers[int(match.group(1))].layer_number - 1}"

    def global_expert(match):
        first = 0 if args.bug == "local-experts" else parallel_state.get_expert_model_parallel_rank() * EXPERTS // args.ep
        return f"experts.{first + int(match.group(1))}"

    def tp_split(param):  # an expert (megatron marks it allreduce False) is split over the expert TP ranks
        if getattr(param, "allreduce", True) is False:
            return (parallel_state.get_expert_tensor_parallel_world_size(),
                    parallel_state.get_expert_tensor_parallel_rank())
        return args.tp, parallel_state.get_tensor_model_parallel_rank()

    with torch.no_grad():
        for local, param in model.named_parameters():
            if param.ndim == 1:
                continue
            name = local if args.bug == "local-names" else re.sub(r"^decoder\.layers\.(\d+)", global_layer, local)
            name = re.sub(r"experts\.local_experts\.(\d+)", global_expert, name)
            split = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            tp, tp_rank = tp_split(param)
            shape = [size * tp if dim == split else size for dim, size in enumerate(param.shape)]
            whole = 0.02 * torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            param.copy_(whole if split is None else whole.chunk(tp, split)[tp_rank])


if args.draw_weights:
    draw_weights()
sharded = args.clip is None  # the distributed optimizer, unless this script clips main_grad itself
ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=sharded), model)
if args.loss == "megatron":
    config.finalize_model_grads_func = finalize_model_grads  # the schedule calls it, with the step's token count
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0 if sharded else 0.0,
                                                   use_distributed_optimizer=sharded), [ddp])

dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()


def batch(step):
    """The whole batch of the step, this DP rank's rows, then this CP rank's zigzag share of them."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB // 2 if args.half_vocab else VOCAB, (BATCH, SEQ + 1), generator=g)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[1, 3:] = 0  # uneven: the second row's loss is on 3 tokens only
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    whole = {"tokens": tokens[rows, :-1], "labels": tokens[rows, 1:], "loss_mask": loss_mask[rows],
             "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)[rows], "cu_seqlens": None}
    cp_group = parallel_state.get_context_parallel_group()
    return get_batch_on_this_cp_rank(whole, is_hybrid_cp=False, cp_group=cp_group), loss_mask.sum()


def packed_batch(step):
    """--packed: the step's documents (of uneven lengths), this DP rank's share of them packed into one
    row, each document padded to a multiple of 2*CP, with PackedSeqParams for the model; then this CP
    rank's chunks of every document (get_batch_on_this_cp_rank given cu_seqlens)."""
    g = torch.Generator().manual_seed(step)
    documents = [torch.randint(0, VOCAB, (length,), generator=g) for length in (5, 11, 7, 9)]
    cp = parallel_state.get_context_parallel_world_size()
    tokens, labels, mask, positions, padded_bounds, real_bounds = [], [], [], [], [0], [0]
    for document in documents[dp_rank * len(documents) // dp:(dp_rank + 1) * len(documents) // dp]:
        length = len(document)
        pad = -length % (2 * cp)
        tokens.append(torch.cat([document, torch.zeros(pad, dtype=torch.long)]))
        labels.append(torch.cat([document[1:], torch.zeros(pad + 1, dtype=torch.long)]))
        mask.append(torch.cat([torch.ones(length - 1), torch.zeros(pad + 1)]))
        positions.append(torch.arange(length + pad))
        padded_bounds.append(padded_bounds[-1] + length + pad)
        real_bounds.append(real_bounds[-1] + length)
    padded = torch.tensor(padded_bounds, dtype=torch.int32)
    real = torch.tensor(real_bounds, dtype=torch.int32)
    row = {"tokens": torch.cat(tokens)[None], "labels": torch.cat(labels)[None], "loss_mask": torch.cat(mask)[None],
           "position_ids": torch.cat(positions)[None], "cu_seqlens": padded[None], "cu_seqlens_padded": padded[None]}
    mine = get_batch_on_this_cp_rank(row, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group(),
                                     use_per_sequence_balancing=args.bug == "row-split")
    longest = int((padded[1:] - padded[:-1]).max())
    mine["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest,
        cp_group=parallel_state.get_context_parallel_group())
    return mine, torch.tensor(float(sum(len(document) - 1 for document in documents)))


def clip_gradients(max_norm):
    """Scale the gradients so that their global norm is at most max_norm. A TP-split parameter's
    gradient is split over the TP ranks; a replicated one counts once (TP rank 0's)."""
    first = parallel_state.get_tensor_model_parallel_rank() == 0
    squares = torch.zeros(())
    for param in model.parameters():
        if args.bug == "local-clip" or first or getattr(param, "tensor_model_parallel", False):
            squares += param.main_grad.square().sum()
    if args.bug != "local-clip":
        dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
    scale = max_norm / (squares.sqrt() + 1e-6)
    if scale < 1:
        for param in model.parameters():
            param.main_grad.mul_(scale)


def forward_step(data_iterator, module):
    """--pp, --loss megatron: megatron-core's schedule calls this on every stage."""
    mine, total_tokens = next(data_iterator)
    logits = module(mine["tokens"], mine["position_ids"], attention_mask=None)
    return logits, partial(megatron_loss if args.loss == "megatron" else loss_of, mine, total_tokens)


def megatron_loss(mine, total_tokens, logits):
    """--loss megatron, as megatron's pretrain_gpt: the rank's token-loss sum, its token count, and
    the sum and count to report (the whole batch's mean, dumped)."""
    dumper.add("logits", "logits", logits, megalign.Sharding(dp_dim=0, seq_dim=1, tp_dim=2))
    per_token = tensor_parallel.vocab_parallel_cross_entropy(logits, mine["labels"])
    summed = (per_token * mine["loss_mask"]).sum()
    tokens = mine["loss_mask"].sum().int()
    reported = torch.stack([summed.detach(), tokens.float()])
    dist.all_reduce(reported, group=dp_cp)
    dumper.add("loss", "loss", reported[0] / reported[1])
    return summed, tokens, {"lm loss": reported}


def loss_of(mine, total_tokens, logits):
    """--pp, on the last stage: the loss, as the step without a schedule computes it."""
    dumper.add("logits", "logits", logits, megalign.Sharding(dp_dim=0, seq_dim=1, tp_dim=2))
    per_token = tensor_parallel.vocab_parallel_cross_entropy(logits, mine["labels"])
    loss = (per_token * mine["loss_mask"]).sum() / total_tokens
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=dp_cp)
    dumper.add("loss", "loss", reported)
    return loss, mine["loss_mask"].sum().int(), {"loss": reported}  # calculate_per_token_loss: not divided again


def pipeline_step(step):
    """--pp, --loss megatron: the step through megatron-core's schedule (the plain batch: not --packed)."""
    mine, total_tokens = batch(step)
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([(mine, total_tokens)]),
                                model=[ddp], num_microbatches=1, seq_length=SEQ,
                                micro_batch_size=mine["tokens"].shape[0])
    if args.loss != "megatron":  # megatron's convention: the schedule finalizes, with the step's token count
        finalize_model_grads([ddp])


def step_without_schedule(step):
    """One forward and backward of the step's batch, the loss the script's own."""
    mine, total_tokens = packed_batch(step) if args.packed else batch(step)
    logits = ddp(mine["tokens"], mine["position_ids"], attention_mask=None,  # [b, s, vocab/tp]
                 packed_seq_params=mine.get("packed_seq_params"))
    dumper.add("logits", "logits", logits, megalign.Sharding(dp_dim=0, seq_dim=1, tp_dim=2))
    per_token = tensor_parallel.vocab_parallel_cross_entropy(logits, mine["labels"])
    summed = (per_token * mine["loss_mask"]).sum()
    count = mine["loss_mask"].sum() if args.bug == "local-tokens" else total_tokens
    loss = summed / count  # DDP sums the gradients over DP x CP (calculate_per_token_loss: no averaging)
    loss.backward()
    finalize_model_grads([ddp])
    if args.bug == "zero-embedding-grad" and parallel_state.get_tensor_model_parallel_rank() == 0:
        model.embedding.word_embeddings.weight.main_grad.zero_()
    reported = loss.detach()
    dist.all_reduce(reported, group=dp_cp)
    dumper.add("loss", "loss", reported)


dumper = megalign.Dumper.from_env(steps=[1, 2], params=True, stats_only=args.stats_only)
dumper.watch(ddp)  # every module's output and its gradient; parameter gradients where DDP leaves them
for step in range(3):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    with dumper.step(step):
        if args.pp > 1 or args.loss == "megatron":
            pipeline_step(step)
        else:
            step_without_schedule(step)
    if args.clip is not None:
        clip_gradients(args.clip)
    optimizer.step()
dumper.close()
dist.destroy_process_group()
