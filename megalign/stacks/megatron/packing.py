"""Packed (THD) rows for megatron-core: PackedSeqParams, and the per-document split over CP ranks.

A packed row holds several documents back to back, each padded to a multiple of 2*cp. Attention
and RoPE restart at every document (megatron reads the boundaries from PackedSeqParams); CP ranks
take two zigzag chunks of every document, as megatron's get_batch_on_this_cp_rank does when the
batch carries cu_seqlens.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_batch_on_this_cp_rank

from megalign.dump.layout import BatchRow

CU_SEQLENS = ("cu_seqlens", "cu_seqlens_padded")


def packed_seq_params(row: BatchRow, cp_group, device) -> PackedSeqParams:
    """cu_seqlens count real tokens; the padded ones are where documents start in the row."""
    real = torch.tensor([0, *accumulate(row.lengths)], dtype=torch.int32, device=device)
    padded = torch.tensor(row.bounds, dtype=torch.int32, device=device)
    longest = max(end - start for start, end in zip(row.bounds[:-1], row.bounds[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest,
                           cp_group=cp_group)


def split_packed_over_cp(batch: dict, bounds: tuple[int, ...], cp_group) -> dict:
    """This CP rank's tokens of one packed row cut at `bounds` (layout.cp_split_bounds), by megatron's
    own split: per document, or, with the row's two ends, as one long sequence (--packed-split row, the
    classic bug kept reachable)."""
    cu_seqlens = torch.tensor([bounds], dtype=torch.int32)
    batch = get_batch_on_this_cp_rank({**batch, "cu_seqlens": cu_seqlens, "cu_seqlens_padded": cu_seqlens},
                                      is_hybrid_cp=False, cp_group=cp_group,
                                      use_per_sequence_balancing=len(bounds) == 2)
    return {key: value for key, value in batch.items() if key not in CU_SEQLENS}
