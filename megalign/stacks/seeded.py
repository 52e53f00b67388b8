"""Random weights that do not depend on the layout, each rank drawing only what its shard reads.

A parameter's full tensor, flattened, is cut into chunks of CHUNK elements (the last one shorter);
chunk i is drawn by a generator seeded from (seed, name, i). So every layout holds the same numbers
(and a full tensor is its shards put back together), while a rank draws only the chunks its shard
overlaps: its own rows for a split of dim 0, every chunk for a split of the last dim whose rows are
shorter than a chunk. A chunk is always drawn whole, since torch's sampler fills in blocks of 16
and a chunk's numbers depend on its length. Chunks are drawn on threads (each on its own generator:
the numbers do not depend on the thread), as many as this rank's share of the cores, always on the
CPU, so that a GPU run holds the same weights as a CPU run (a device's generator would be faster,
but its numbers are its own: GPU against CPU runs, which gpu.sh compares, would hold other weights).
On a GPU each chunk is drawn into page-locked memory and its copy queued.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from megalign.stacks.shard import ParamShard, WeightSource

CHUNK = 1 << 20


def seeded_weights(seed: int, std: float, chunk: int = CHUNK) -> WeightSource:
    """N(0, std) for matrices and biases, N(1, std) for norm scales."""
    def shard_of(name: str, shard: ParamShard) -> torch.Tensor:
        mean = 1.0 if _is_norm_scale(name) else 0.0
        # A whole tensor is drawn chunk by chunk into the parameter's device, each chunk's copy there
        # overlapping the others' drawing. A shard is cut from a full tensor in host memory, whose
        # untouched pages (the chunks not drawn) are never allocated.
        full = torch.empty(shard.shape, device=shard.device if shard.whole else "cpu").flatten()
        starts, length = shard.runs()

        def draw(index: int) -> None:
            generator = torch.Generator().manual_seed(_chunk_seed(seed, name, index))
            piece = full[index * chunk:(index + 1) * chunk]
            if piece.device.type == "cpu":
                piece.normal_(mean, std, generator=generator)
                return
            # Page-locked, the copy is queued and the thread draws the next chunk: from pageable memory
            # torch copies through a staging buffer and waits (an 8B model's 32 GB of fp32, a run).
            # The caching host allocator reuses the block once the copy that read it has run.
            drawn = torch.empty(piece.shape, pin_memory=True)
            drawn.normal_(mean, std, generator=generator)
            piece.copy_(drawn, non_blocking=True)

        chunks = _chunks_read(starts, length, chunk, full.numel())
        with ThreadPoolExecutor(min(_threads(), max(1, len(chunks)))) as pool:
            list(pool.map(draw, chunks))
        return shard.of(full.view(shard.shape))

    return shard_of


def _is_norm_scale(name: str) -> bool:
    return "norm" in name.split(".")[-2] and name.endswith(".weight") or name.endswith("layer_norm_weight")


def _chunk_seed(seed: int, name: str, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}/{index}".encode(), digest_size=8).digest(), "little")


def _chunks_read(starts: torch.Tensor, length: int, chunk: int, numel: int) -> list[int]:
    """The chunks that the runs [start, start + length) overlap."""
    if length == 0 or numel == 0:
        return []
    count = (numel + chunk - 1) // chunk
    edges = torch.zeros(count + 1, dtype=torch.long)
    edges.index_add_(0, starts // chunk, torch.ones_like(starts))
    edges.index_add_(0, (starts + length - 1) // chunk + 1, -torch.ones_like(starts))
    return torch.nonzero(edges.cumsum(0)[:count]).flatten().tolist()


def _threads() -> int:
    """This rank's share of the cores it may run on (torchrun starts one process per GPU)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)
