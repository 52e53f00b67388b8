"""Write pairs of sglang dumps, each form of sglang's dims grammar that lines up differently on two sides,
with sglang's own dumper code (sglang_writer.load_sglang_dumper).

Ranks are emulated in one process as sglang's own comparator tests emulate them: one dumper a rank, whose
rank and parallel info (`megatron_parallel_info`) are given instead of read from torch.distributed.

    python sglang_forms_writer.py OUT

writes every form of FORMS twice: OUT/FORM/ok/{a,b}/exp (the baseline, world 1, and the target), and
OUT/FORM/planted/{a,b}/exp, where the target's last rank's shard of the form's tensor is 1% off.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from sglang_writer import load_sglang_dumper

T, HEADS, HEAD_DIM = 6, 4, 3
# Request a: a 5-token prompt then 3 decoded tokens; b: a 1-token prompt then 3: 8 + 4 tokens, packed.
A, B = [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24]


@functools.cache
def _dumper_module():
    return load_sglang_dumper()


def write(out: Path, ranks: list[dict], dumps) -> None:
    """`dumps(dumper, rank)`: what the rank dumps, given its dumper; `ranks`: each rank's parallel info."""
    module = _dumper_module()
    for rank, info in enumerate(ranks):
        module._get_rank = lambda rank=rank: rank
        module._compute_static_meta = lambda rank=rank, info=info: {
            "world_rank": rank, "world_size": len(ranks), "megatron_parallel_info": info}
        dumper = module._Dumper(config=module.DumperConfig.from_env())
        dumper.configure(enable=True, dir=str(out), exp_name="exp", enable_output_console=False)
        dumps(dumper, rank)


def tp(size: int) -> list[dict]:
    return [{"tp_rank": r, "tp_size": size, "cp_rank": 0, "cp_size": 1} for r in range(size)]


def cp(size: int) -> list[dict]:
    return [{"tp_rank": 0, "tp_size": 1, "cp_rank": r, "cp_size": size} for r in range(size)]


def hidden(tokens: list[int], positions: list[int], width: int = HEADS * HEAD_DIM) -> torch.Tensor:
    """What every token's tensor holds: a function of its token and position only."""
    grid = torch.arange(width, dtype=torch.float32)
    return torch.stack([torch.sin(grid * 0.1 * t + p) for t, p in zip(tokens, positions)])


def planted(tensor: torch.Tensor, rank: int, last: int, plant: bool) -> torch.Tensor:
    return tensor * 1.01 if plant and rank == last else tensor


def fused(out: Path, plant: bool) -> None:
    """`t num_heads head_dim` against `t (num_heads*head_dim)[tp]`."""
    whole = hidden(list(range(T)), list(range(T))).view(T, HEADS, HEAD_DIM)
    write(out / "a", tp(1), lambda d, r: d.dump("attn", whole, dims="t num_heads head_dim"))
    shards = whole.chunk(2, dim=1)
    write(out / "b", tp(2), lambda d, r: d.dump("attn", planted(shards[r].reshape(T, -1), r, 1, plant),
                                                dims="t (num_heads*head_dim)[tp]"))


def squeezed(out: Path, plant: bool) -> None:
    """`t h` against `t 1 h[tp]`."""
    whole = hidden(list(range(T)), list(range(T)))
    write(out / "a", tp(1), lambda d, r: d.dump("attn", whole, dims="t h"))
    shards = whole[:, None].chunk(2, dim=2)
    write(out / "b", tp(2), lambda d, r: d.dump("attn", planted(shards[r], r, 1, plant), dims="t 1 h[tp]"))


def reordered(out: Path, plant: bool) -> None:
    """`b h d` against `b d h[tp]`."""
    whole = hidden(list(range(T)), list(range(T))).view(T, HEADS, HEAD_DIM)
    write(out / "a", tp(1), lambda d, r: d.dump("attn", whole, dims="b h d"))
    shards = whole.transpose(1, 2).chunk(2, dim=2)
    write(out / "b", tp(2), lambda d, r: d.dump("attn", planted(shards[r].contiguous(), r, 1, plant),
                                                dims="b d h[tp]"))


def thd_zigzag(out: Path, plant: bool) -> None:
    """`t h` at world 1 against `t[cp:zigzag] h` at CP=2, 8 + 4 tokens packed, each sequence zigzagged
    on its own (megatron's THD split: TE's thd_get_partitioned_indices)."""
    tokens, positions = A + B, list(range(len(A))) + list(range(len(B)))
    bounds = torch.tensor([0, len(A), len(A) + len(B)], dtype=torch.int32)
    whole = hidden(tokens, positions)

    def rank_rows(rank: int) -> list[int]:  # each sequence's chunks rank and 3 - rank, of 4
        rows = []
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            chunk = (end - start) // 4
            rows += [start + c * chunk + i for c in (rank, 3 - rank) for i in range(chunk)]
        return rows

    def dumps(d, r, size):
        rows = rank_rows(r) if size == 2 else list(range(len(tokens)))
        d.dump("cu_seqlens_q", bounds)
        d.dump("input_ids", torch.tensor(tokens)[rows], dims="t[cp:zigzag]" if size == 2 else "t")
        d.dump("attn", planted(whole[rows], r, 1, plant), dims="t[cp:zigzag] h" if size == 2 else "t h")

    write(out / "a", cp(1), lambda d, r: dumps(d, r, 1))
    write(out / "b", cp(2), lambda d, r: dumps(d, r, 2))


def server_against_thd(out: Path, plant: bool) -> None:
    """An sglang server's prefill of a and b, then 3 decode passes, its `seq_lens` each request's new
    tokens in the pass (as sglang's comparator reads them), against megatron's THD forward of the same
    8 + 4 tokens at TP=2 (`t h[tp]`, `cu_seqlens_q`)."""
    passes = [[("a", 0, A[:5]), ("b", 0, B[:1])]] + [[("a", 4 + k, A[4 + k:5 + k]), ("b", k, B[k:k + 1])]
                                                      for k in range(1, 4)]

    def server(d, r):
        for batch in passes:
            ids = [t for _, _, tokens in batch for t in tokens]
            positions = [start + k for _, start, tokens in batch for k in range(len(tokens))]
            d.dump("input_ids", torch.tensor(ids))
            d.dump("positions", torch.tensor(positions))
            d.dump("seq_lens", torch.tensor([len(tokens) for _, _, tokens in batch]))
            d.dump("rids", [rid for rid, _, _ in batch])
            d.dump("hidden", hidden(ids, positions))
            d.step()

    tokens, positions = A + B, list(range(len(A))) + list(range(len(B)))
    shards = hidden(tokens, positions).chunk(2, dim=1)

    def megatron(d, r):
        d.dump("input_ids", torch.tensor(tokens), dims="t")
        d.dump("position_ids", torch.tensor(positions), dims="t")
        d.dump("cu_seqlens_q", torch.tensor([0, len(A), len(A) + len(B)], dtype=torch.int32))
        d.dump("hidden", planted(shards[r], r, 1, plant), dims="t h[tp]")

    write(out / "a", tp(1), server)
    write(out / "b", tp(2), megatron)


FORMS = {"fused": fused, "squeezed": squeezed, "reordered": reordered, "thd_zigzag": thd_zigzag,
         "server_against_thd": server_against_thd}


if __name__ == "__main__":
    for form, writer in FORMS.items():
        for plant in (False, True):
            writer(Path(sys.argv[1]) / form / ("planted" if plant else "ok"), plant)
