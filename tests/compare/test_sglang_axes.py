"""sglang's dims grammar beyond TP and CP, written by sglang's own dumper at emulated ranks
(sglang_ranks_writer.py): expert axes (megatron's ep, sglang's moe_ep and moe_tp), the `#` section's
`dp:=` with an idle DP rank, a recompute on one side only, and pipeline stages told apart by their
`layer_id` tag. Each correct target exits 0 against a world-1 baseline; its twin, one shard planted,
exits 1 at that tensor."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import invoke

WRITER = Path(__file__).with_name("sglang_ranks_writer.py")
torch.manual_seed(0)
BEFORE, AFTER = torch.randn(6, 8), torch.randn(6, 8)  # `t h`, the same on every rank
PLANT = 1.01


class Dump:
    """The dumps of one run, in the order they are made, written by the writer at once."""

    def __init__(self, folder: Path, infos: list[dict]):
        """`infos`: each rank's parallel info ({"megatron": {...}} or {"sglang": {...}})."""
        self.folder, self.world_size, self.infos, self.dumps = folder, len(infos), infos, []
        folder.mkdir()

    def add(self, rank: int, name: str, tensor: torch.Tensor, **fields) -> None:
        path = self.folder / f"t{len(self.dumps)}.pt"
        torch.save(tensor.contiguous().clone(), path)
        self.dumps.append({"rank": rank, "name": name, "tensor": str(path), "info": self.infos[rank], **fields})

    def around(self, body) -> None:
        """`before` on every rank, the ranks' own dumps of the case, `after` on every rank."""
        for rank in range(self.world_size):
            self.add(rank, "before", BEFORE, dims="t h")
        body()
        for rank in range(self.world_size):
            self.add(rank, "after", AFTER, dims="t h")

    @property
    def out(self) -> Path:
        return self.folder / "out"


def written(*runs: Dump) -> list[Path]:
    """The runs' folders, written by one writer process."""
    spec = runs[0].folder.parent / "spec.json"
    spec.write_text(json.dumps([{"out": str(r.out), "world_size": r.world_size, "dumps": r.dumps} for r in runs]))
    result = subprocess.run([sys.executable, str(WRITER), str(spec)], capture_output=True, text=True, timeout=300,
                            cwd=WRITER.parent)
    assert result.returncode == 0, result.stderr[-4000:]
    return [r.out for r in runs]


def compare(tmp_path: Path, a: Path, b: Path):
    report = tmp_path / f"r{len(list(tmp_path.glob('r*.jsonl')))}.jsonl"
    result = invoke("compare", a, b, "--json", report)
    lines = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else [{}]
    return result, lines[-1]


def baseline(tmp_path: Path, name: str, whole: torch.Tensor, dims: str) -> Dump:
    run = Dump(tmp_path / "baseline", [{}])
    run.around(lambda: run.add(0, name, whole, dims=dims))
    return run


def sharded_run(tmp_path: Path, label: str, name: str, shards: list[tuple[dict, torch.Tensor]], dims: str,
                plant: int | None = None) -> Dump:
    """A run whose rank r dumps shards[r] (its parallel info, its piece); `plant`: that rank's piece scaled."""
    run = Dump(tmp_path / label, [info for info, _ in shards])
    run.around(lambda: [run.add(rank, name, piece * (PLANT if rank == plant else 1), dims=dims)
                        for rank, (_, piece) in enumerate(shards)])
    return run


def cut(whole: torch.Tensor, plugin: str, axes: list[tuple[str, int, int | None]]):
    """Each rank's (info, piece) of `whole` over `axes` ((axis, size, dim): outermost first; dim None:
    not split, the ranks hold replicas)."""
    shards = []
    for ranks in itertools.product(*(range(size) for _, size, _ in axes)):
        piece = whole
        for (_, size, dim), rank in zip(axes, ranks):
            piece = piece if dim is None else piece.chunk(size, dim)[rank]
        info = {key: value for (axis, size, _), rank in zip(axes, ranks)
                for key, value in ((f"{axis}_rank", rank), (f"{axis}_size", size))}
        shards.append(({plugin: info}, piece))
    return shards


EXPERTS = torch.randn(8, 6, 4)  # e t h
EXPERTS_BSH = torch.randn(2, 4, 8, 6)  # b e s h

CASES = {
    "ep at world 2": ("experts", EXPERTS, "e t h", "e[ep] t h", "megatron", [("ep", 2, 0)]),
    "ep, cp, tp at world 8": ("experts", EXPERTS_BSH, "b e s h", "b e[ep] s[cp] h[tp]", "megatron",
                              [("ep", 2, 1), ("cp", 2, 2), ("tp", 2, 3)]),
    "moe_ep at world 2": ("experts", EXPERTS, "e t h", "e[moe_ep] t h", "sglang", [("moe_ep", 2, 0)]),
    "moe_ep, moe_tp at world 8": ("experts", EXPERTS, "e t h", "e[moe_ep] t h[moe_tp]", "sglang",
                                  [("moe_ep", 4, 0), ("moe_tp", 2, 2)]),
}


@pytest.mark.parametrize("case", CASES)
def test_expert_axes_are_put_back_together(tmp_path, case):
    name, whole, whole_dims, dims, plugin, axes = CASES[case]
    shards = cut(whole, plugin, axes)
    base, target, planted = written(baseline(tmp_path, name, whole, whole_dims),
                                    sharded_run(tmp_path, "target", name, shards, dims),
                                    sharded_run(tmp_path, "twin", name, shards, dims, plant=len(shards) - 1))
    result, s = compare(tmp_path, base, target)
    assert result.exit_code == 0, result.output
    assert s["passed"] == 3 and s["not_reassemblable"] == 0, s
    twin, s = compare(tmp_path, base, planted)
    assert twin.exit_code == 1 and s["first_divergence"] == f"activation {name}", twin.output


def test_an_idle_dp_rank_holding_an_empty_tensor_is_left_out(tmp_path):
    """`# dp:=attn_dp`: one attention-DP rank holds the tokens, the other (idle) an empty tensor."""
    whole = torch.randn(6, 8)
    dims = "t h[attn_tp] # dp:=attn_dp"
    shards = [(info, piece if info["sglang"]["attn_dp_rank"] == 0 else piece[:0])
              for info, piece in cut(whole, "sglang", [("attn_dp", 2, None), ("attn_tp", 2, 1)])]
    base, target, planted = written(baseline(tmp_path, "attn_out", whole, "t h"),
                                    sharded_run(tmp_path, "target", "attn_out", shards, dims),
                                    sharded_run(tmp_path, "twin", "attn_out", shards, dims, plant=1))
    result, s = compare(tmp_path, base, target)
    assert result.exit_code == 0, result.output
    assert s["passed"] == 3, s
    twin, s = compare(tmp_path, base, planted)
    assert twin.exit_code == 1 and s["first_divergence"] == "activation attn_out", twin.output


def recomputed_run(tmp_path: Path, label: str, whole: torch.Tensor, again: torch.Tensor) -> Dump:
    """The forward dumps `mlp` under megatron's checkpointing (original), the backward's recompute
    dumps it again (recompute, holding `again`)."""
    run = Dump(tmp_path / label, [{}])
    run.around(lambda: (run.add(0, "mlp", whole, dims="t h", recompute="original"),
                        run.add(0, "mlp", again, dims="t h", recompute="recompute")))
    return run


def test_a_recompute_on_one_side_is_checked_against_its_original(tmp_path):
    whole = torch.randn(6, 8)
    base, target, planted = written(baseline(tmp_path, "mlp", whole, "t h"),
                                    recomputed_run(tmp_path, "target", whole, whole),
                                    # the twin: the recompute gives other values than the forward did
                                    recomputed_run(tmp_path, "twin", whole, whole * PLANT))
    result, s = compare(tmp_path, base, target)
    assert result.exit_code == 0, result.output
    assert s["passed"] == 3 and s["missing_a"] == s["missing_b"] == 0, s
    twin, s = compare(tmp_path, base, planted)
    assert twin.exit_code == 1 and s["first_divergence"] == "activation mlp", twin.output
    assert "replicas disagree (recomputed copy vs original)" in twin.output


def staged_run(tmp_path: Path, label: str, layers: list[torch.Tensor], ranks: int, plant: int | None = None):
    """Each layer dumps `hidden` tagged layer_id: all on one rank, or one layer per pipeline stage."""
    run = Dump(tmp_path / label, [{"megatron": {"pp_rank": rank, "pp_size": ranks}} for rank in range(ranks)])
    run.around(lambda: [run.add(layer % ranks, "hidden", t * (PLANT if layer == plant else 1), dims="t h",
                                tags={"layer_id": layer}) for layer, t in enumerate(layers)])
    return run


def test_pipeline_stages_tagged_by_layer_are_two_tensors(tmp_path):
    layers = [torch.randn(6, 8), torch.randn(6, 8)]
    base, target, planted = written(staged_run(tmp_path, "baseline", layers, 1),
                                    staged_run(tmp_path, "target", layers, 2),
                                    staged_run(tmp_path, "twin", layers, 2, plant=1))
    result, s = compare(tmp_path, base, target)
    assert result.exit_code == 0, result.output
    assert s["passed"] == 4 and s["missing_a"] == s["missing_b"] == 0, s
    twin, s = compare(tmp_path, base, planted)
    assert twin.exit_code == 1 and s["first_divergence"] == "activation hidden[layer_id=1]", twin.output


def test_an_unknown_word_after_the_hash_is_refused(tmp_path):
    whole = torch.randn(6, 8)
    shards = cut(whole, "megatron", [("tp", 2, None)])
    base, typo = written(baseline(tmp_path, "attn_out", whole, "t h"),
                         sharded_run(tmp_path, "typo", "attn_out", shards, "t h # tp:replicatd"))
    result = invoke("compare", base, typo)
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if "replicatd" in line]
    assert "'tp:replicatd' after '#' is neither 'dp:=<axis>' nor '<axis>:replicated'" in line
