"""The loss under context parallelism, and the classic way to get it wrong.

`global` (right): each rank sums its token losses and divides by the valid-token count all-reduced
over the DP x CP group, so the per-rank losses add up to the single-rank loss and the gradients,
summed over DP and CP ranks by DDP, equal the single-rank gradients. `local` (the bug, kept
reachable with --loss-norm local): dividing by the rank's own count scales every gradient by about
DP x CP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalign.capture.dumper import Dumper
from megalign.dump.format import Kind
from megalign.dump.sharding import Sharding
from megalign.stacks.batch import mean_token_loss


def token_loss(dumper: Dumper, loss_mask: torch.Tensor, loss_norm: str, per_token: torch.Tensor):
    """megatron loss_func: `per_token` is [b, s_local] cross-entropy from GPTModel(labels=...)."""
    from megatron.core import parallel_state

    # The ranks that share one batch's tokens: DP ranks hold other sequences, CP ranks other chunks.
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dumper.add(Kind.LOGPROBS, "logprobs", -per_token, Sharding(seq_dim=1, dp_dim=0))
    mask = loss_mask.float()
    local_count = mask.sum()
    count = local_count.clone()
    if loss_norm == "global":
        dist.all_reduce(count, group=group)
    loss = mean_token_loss(per_token, mask, count)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    dumper.add(Kind.LOSS, "loss", total, Sharding())
    # With calculate_per_token_loss, megatron neither divides nor rescales the returned loss.
    return loss, local_count.int(), {"loss": total}
