"""DTensor pieces (sharding.mesh) in real dump files, written rank by rank with the dump's own
writer as torch's placements leave them: uneven and empty Shard pieces, Shard(1), Replicate,
Partial(sum), and a 2-D mesh whose Partial sums are replicas of each other. compare puts each back
together and agrees with the whole tensors dumped by one process; a Partial recorded as a replica
is caught (the twin); a malformed mesh record is bad input (exit 2); pieces that overlap or leave
a hole are not reassemblable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import megalign
from megalign.compare.plan import Unassemblable, make_plan
from megalign.dump.format import DUMP_META, RankCoords, write_json_atomic
from megalign.dump.layout import Layout
from megalign.dump.meta import dump_meta
from megalign.dump.sharding import MeshPlacement, Sharding
from megalign.dump.writer import RankWriter
from tests.compare.test_hostile_dumps import edit_json, exit_2
from tests.conftest import invoke
from tests.unit.test_plan import covered, shard

WHOLE = {name: torch.randn(shape, generator=torch.Generator().manual_seed(i))
         for i, (name, shape) in enumerate({"uneven": (5, 3), "empty": (1, 4), "cols": (3, 4), "partial": (4, 2),
                                            "replicated": (3,), "mesh2d": (2, 3)}.items())}


def piece(name: str, rows=slice(None), cols=slice(None), placements=("S0",), mesh=(2,), coord=(0,), part=None):
    """(name, the local tensor, its Sharding): rows/cols of the whole, or `part` (a Partial term)."""
    whole = WHOLE[name]
    local = whole[rows] if whole.ndim == 1 else whole[rows, cols]
    offset = tuple(s.indices(n)[0] for s, n in zip((rows, cols), whole.shape))
    placement = MeshPlacement(shape=mesh, coord=coord, placements=placements, whole=tuple(whole.shape),
                              offset=offset)
    return name, local if part is None else part, Sharding(mesh=placement)


def partial_terms(name: str, ranks: int, seed: int) -> list[torch.Tensor]:
    """Terms that sum to the whole, each far from it."""
    terms = [torch.randn(WHOLE[name].shape, generator=torch.Generator().manual_seed(seed + r)) for r in range(ranks - 1)]
    return [*terms, WHOLE[name] - sum(terms)]


def world2() -> list[list]:
    p = partial_terms("partial", 2, 100)
    return [[piece("uneven", slice(0, 3)), piece("empty", slice(0, 1)), piece("cols", cols=slice(0, 2), placements=("S1",)),
             piece("partial", placements=("P",), part=p[0]), piece("replicated", placements=("R",))],
            [piece("uneven", slice(3, 5), coord=(1,)), piece("empty", slice(1, 1), coord=(1,)),
             piece("cols", cols=slice(2, 4), placements=("S1",), coord=(1,)),
             piece("partial", placements=("P",), coord=(1,), part=p[1]), piece("replicated", placements=("R",), coord=(1,))]]


def world4() -> list[list]:
    """A 2x2 mesh, (Replicate, Partial): ranks 0+1 and 2+3 each sum to the whole, with other terms."""
    terms = [partial_terms("mesh2d", 2, 200), partial_terms("mesh2d", 2, 300)]
    return [[piece("mesh2d", placements=("R", "P"), mesh=(2, 2), coord=(i, j), part=terms[i][j])]
            for i in range(2) for j in range(2)]


def write(out: Path, ranks: list[list]) -> Path:
    for rank, pieces in enumerate(ranks):
        writer = RankWriter(out, RankCoords(rank=rank, dp_rank=rank))
        for name, tensor, sharding in pieces:
            writer.add("param_grad", name, tensor, sharding)
        writer.close()
    write_json_atomic(out / DUMP_META, dump_meta("python", "backward", Layout(dp=len(ranks)),
                                                 {"dtype": "fp32", "stats_only": False, "steps": []}))
    return out


@pytest.fixture
def dumps(tmp_path) -> dict[str, Path]:
    whole = [[(name, tensor, Sharding()) for name, tensor in WHOLE.items() if name != "mesh2d"]]
    return {"one": write(tmp_path / "one", whole), "two": write(tmp_path / "two", world2()),
            "one_2d": write(tmp_path / "one_2d", [[("mesh2d", WHOLE["mesh2d"], Sharding())]]),
            "four": write(tmp_path / "four", world4())}


def test_every_placement_is_put_back_together(dumps):
    two = megalign.open(dumps["two"])
    for name, whole in WHOLE.items():
        if name != "mesh2d":
            assert torch.equal(two.tensor("param_grad", name), whole) or name == "partial", name
    assert torch.allclose(two.tensor("param_grad", "partial"), WHOLE["partial"], atol=1e-6)
    assert torch.allclose(megalign.open(dumps["four"]).tensor("param_grad", "mesh2d"), WHOLE["mesh2d"], atol=1e-6)
    result = invoke("compare", dumps["one"], dumps["two"])
    assert result.exit_code == 0, result.output
    assert "5 compared, 5 passed, 0 failed" in result.output
    result = invoke("compare", dumps["one_2d"], dumps["four"])
    assert result.exit_code == 0, result.output


def test_a_partial_read_as_a_replica_is_caught(dumps):
    """Twin: without the sum, rank 0's term stands for the whole (and rank 1's disagrees with it)."""
    for rank in (0, 1):
        edit_json(dumps["two"] / f"rank-0000{rank}" / "manifest.json",
                  lambda m: next(r for r in m["tensors"] if r["name"] == "partial")["sharding"]["mesh"].update(
                      placements=["R"]))
    result = invoke("compare", dumps["one"], dumps["two"])
    assert result.exit_code == 1, result.output
    assert "first divergence: param_grad partial\n" in result.output


def test_the_plan_explains_the_sum():
    mesh = lambda coord: Sharding(mesh=MeshPlacement((2,), coord, ("P",), (4,), (0,)))  # noqa: E731
    plan = make_plan([shard(0, [4], mesh((0,))), shard(1, [4], mesh((1,)), dp=1)], Layout(dp=2))
    assert plan.explain() == ["4 from 1 piece of 4; DTensor on mesh 2 (P): pieces at their offsets; partial pieces summed",
                              "  rank 0 (tp 0 cp 0 dp 0 pp 0): all of it, as it is",
                              "  rank 1 (tp 0 cp 0 dp 1 pp 0): added to rank 0's piece (partial sum)"]


@pytest.mark.parametrize("whole, offsets, message", [
    ((6, 2), [(0, 0), (2, 0)], "overlap"),
    ((7, 2), [(0, 0), (4, 0)], "do not make up its 7x2"),
])
def test_pieces_that_overlap_or_leave_a_hole_are_unassemblable(whole, offsets, message):
    shards = [shard(r, [3, 2], Sharding(mesh=MeshPlacement((2,), (r,), ("S0",), whole, offsets[r])), dp=r)
              for r in range(2)]
    with pytest.raises(Unassemblable, match=message):
        make_plan(shards, Layout(dp=2))


def test_uneven_pieces_cover_the_whole_once():
    shards = [shard(r, [size, 2], Sharding(mesh=MeshPlacement((3,), (r,), ("S0",), (5, 2), (start, 0))), dp=r)
              for r, (start, size) in enumerate([(0, 2), (2, 2), (4, 1)])]
    assert (covered(make_plan(shards, Layout(dp=3))) == 1).all()


MESH_EDITS = {
    "an unknown placement": (lambda mesh: mesh.update(placements=["X"]), "placements must be one of R, P or S<dim>"),
    "a split dim the tensor lacks": (lambda mesh: mesh.update(placements=["S5"]), "placements must be one of"),
    "a coordinate outside the mesh": (lambda mesh: mesh.update(coord=[2]), "is outside the mesh"),
    "a piece beyond the whole": (lambda mesh: mesh.update(offset=[4, 0]), "does not lie in"),
    "a whole of another rank": (lambda mesh: mesh.update(global_shape=[5]), "must be a list of 2 integers"),
    "a mesh of no dims": (lambda mesh: mesh.update(shape=[]), "must be a non-empty list"),
}


@pytest.mark.parametrize("edit", MESH_EDITS, ids=list(MESH_EDITS))
def test_a_malformed_mesh_record_is_exit_2(dumps, edit):
    change, message = MESH_EDITS[edit]

    def apply(manifest: dict) -> None:
        change(next(r for r in manifest["tensors"] if r["name"] == "uneven")["sharding"]["mesh"])

    edit_json(dumps["two"] / "rank-00000" / "manifest.json", apply)
    exit_2(invoke("compare", dumps["one"], dumps["two"]), message)


def test_a_mesh_beside_a_layout_split_is_exit_2(dumps):
    edit_json(dumps["two"] / "rank-00001" / "manifest.json",
              lambda m: m["tensors"][0]["sharding"].update(dp_dim=0))
    exit_2(invoke("compare", dumps["one"], dumps["two"]), "sharding.mesh places the tensor alone")
    assert json.loads((dumps["two"] / "rank-00001" / "manifest.json").read_text())["tensors"][0]["name"] == "uneven"
