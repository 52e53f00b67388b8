"""Sketches (dump/sketch.py): each rank's, taken at its shard's positions in the whole, sum to the
whole tensor's sketch once compare puts a real stats-only dump back together (TP column and row
shards, fused parts, CP zigzag, SP, DP rows, a partial sum, replicas once); the host's one-pass
kernel and the device's torch ops agree; the twin: shards sketched at their local positions do not
sum to the whole's."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megalign.compare.sources import open_source
from megalign.dump.format import DUMP_META, RankCoords, write_json_atomic
from megalign.dump.layout import Layout, zigzag_chunks
from megalign.dump.meta import dump_meta
from megalign.dump.partial import partial_piece
from megalign.dump.sharding import Sharding
from megalign.dump import sketch
from megalign.dump.sketch import K, device_sketch, encode, rows_and_cols
from megalign.dump.stats import host_summary, summary_of
from megalign.dump.validate import Malformed, check_record
from megalign.dump import writer as writer_module
from megalign.dump.writer import RankWriter

HASHES = sketch.hashes
LAYOUT = Layout(tp=2, cp=2, dp=2)
GEN = torch.Generator().manual_seed(0)
WHOLE = {"col": torch.randn(8, 6, generator=GEN), "row": torch.randn(6, 8, generator=GEN),
         "fused": torch.randn(8, 4, generator=GEN), "act": torch.randn(4, 16, 6, generator=GEN),
         "sp": torch.randn(16, 4, 6, generator=GEN).bfloat16(), "replica": torch.randn(5, generator=GEN),
         "partial": torch.randn(3, 4, generator=GEN, dtype=torch.float64)}
SHARDING = {"col": Sharding(tp_dim=0), "row": Sharding(tp_dim=1), "fused": Sharding(tp_dim=0, tp_parts=2),
            "act": Sharding(dp_dim=0, seq_dim=1, tp_dim=2), "sp": Sharding(seq_dim=0, sp=True, dp_dim=1),
            "replica": Sharding()}


def tp(x: torch.Tensor, dim: int, rank: int, parts: int = 1) -> torch.Tensor:
    return torch.cat([part.chunk(LAYOUT.tp, dim)[rank] for part in x.chunk(parts, dim)], dim)


def zigzag(x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    chunks = x.chunk(2 * LAYOUT.cp, dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(rank, LAYOUT.cp)], dim)


def shard(name: str, c: RankCoords) -> torch.Tensor:
    """Rank c's piece, cut as megatron cuts it (not by the placement rules under test)."""
    x = WHOLE[name]
    if name in ("col", "fused"):
        return tp(x, 0, c.tp_rank, parts=2 if name == "fused" else 1)
    if name == "row":
        return tp(x, 1, c.tp_rank)
    if name == "act":
        return tp(zigzag(x.chunk(LAYOUT.dp, 0)[c.dp_rank], 1, c.cp_rank), 2, c.tp_rank)
    if name == "sp":
        return tp(zigzag(x.chunk(LAYOUT.dp, 1)[c.dp_rank], 0, c.cp_rank), 0, c.tp_rank)
    return x


def coords_of(rank: int) -> RankCoords:
    return RankCoords(rank=rank, tp_rank=rank % 2, cp_rank=rank // 2 % 2, dp_rank=rank // 4)


def write(out: Path, placed: bool) -> Path:
    """A stats-only dump of WHOLE over LAYOUT's 8 ranks; `placed`: each writer knows the layout (the
    Dumper's), else each shard is sketched where it lies locally (the twin)."""
    terms = [torch.randn(WHOLE["partial"].shape, generator=GEN, dtype=torch.float64)
             for _ in range(LAYOUT.dp * LAYOUT.cp - 1)]
    terms.append(WHOLE["partial"] - sum(terms))
    for rank in range(LAYOUT.world_size):
        c = coords_of(rank)
        writer = RankWriter(out, c, stats_only=True)
        if placed:
            writer.layout = LAYOUT
        for name, sharding in SHARDING.items():
            writer.add("activation", name, shard(name, c), sharding)
        writer.add("activation", "partial", *partial_piece(terms[c.dp_rank * LAYOUT.cp + c.cp_rank],
                                                           Sharding(partial="sum"), c, LAYOUT))
        writer.close()
    write_json_atomic(out / DUMP_META, dump_meta("python", "backward", LAYOUT,
                                                 {"dtype": "fp32", "stats_only": True, "steps": []}))
    return out


def sketches(path: Path) -> dict[str, np.ndarray]:
    return {entry.name: entry.load().sketch for entry in open_source(path).entries}


def test_shards_sketches_sum_to_the_whole_tensors_sketch(tmp_path):
    got = sketches(write(tmp_path / "placed", placed=True))
    assert set(got) == set(WHOLE)
    for name, whole in WHOLE.items():
        want = summary_of(whole)[1]
        assert np.allclose(got[name], want, rtol=1e-12, atol=1e-12 * np.abs(want).max()), name


def test_twin_shards_sketched_at_their_local_positions_do_not_sum_to_the_whole(tmp_path):
    got = sketches(write(tmp_path / "local", placed=False))
    for name in ("col", "row", "fused", "act", "sp"):
        assert not np.allclose(got[name], summary_of(WHOLE[name])[1], rtol=1e-3), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: bench/gpu.sh runs it"))])
def test_the_host_kernel_and_the_device_ops_agree_over_finite_values(device):
    """bf16 and float32, NaN and Inf left out (the statistics count them), a scalar, a shard of a
    whole at other positions; the squared sketch estimates the squared norm."""
    x = torch.randn(3, 1000, generator=GEN)
    x[1, 7], x[2, 9] = math.nan, -math.inf
    where = [torch.tensor([0, 5, 2]), torch.arange(1000, 2000)]
    for tensor, placed in ((x, where), (x.bfloat16(), where), (torch.tensor(2.5), [])):
        whole = (6, 3000) if placed else ()
        stats, host = host_summary(tensor, *rows_and_cols(whole, placed))
        on_device = device_sketch(tensor.to(device).reshape(-1), *rows_and_cols(whole, placed, torch.device(device)),
                                  torch.zeros(K, dtype=torch.float64, device=device)).cpu().numpy()
        assert np.allclose(host, on_device, rtol=1e-12, atol=1e-12) and host.shape == (K,)
        finite = tensor.double()[torch.isfinite(tensor)]
        assert float(np.square(host).sum()) == pytest.approx(float(finite.square().sum()), rel=4 * math.sqrt(2 / K))
        assert (stats.nan, stats.inf) == ((1, 1) if placed else (0, 0))


def test_the_device_ops_take_a_long_row_a_few_elements_at_a_time(monkeypatch):
    """A big 1-D tensor is one row: blocked by elements, not rows, its temporaries stay ROWS_AT_ONCE
    long (7 here); the sketch is the same as the host's, for a matrix whose rows a block cuts too."""
    monkeypatch.setattr(sketch, "ROWS_AT_ONCE", 7)
    hashed = []
    monkeypatch.setattr(sketch, "hashes", lambda g: hashed.append(g.numel()) or HASHES(g))
    for tensor, whole, placed in ((torch.randn(100, generator=GEN), (300,), [torch.arange(150, 250)]),
                                  (torch.randn(3, 10, generator=GEN), (6, 30), [torch.tensor([0, 5, 2]),
                                                                               torch.arange(10, 20)])):
        located = rows_and_cols(whole, placed)
        assert np.allclose(device_sketch(tensor.reshape(-1), *located, torch.zeros(K, dtype=torch.float64)).numpy(),
                           host_summary(tensor, *located)[1],
                           rtol=1e-12, atol=1e-12)
    assert max(hashed) == 7


@pytest.mark.parametrize("sketch", ["not base64!", "AAAA"])
def test_a_sketch_that_is_not_k_float64_values_beside_stats_is_malformed(tmp_path, sketch):
    """validate.py: what is not K float64 values in base64 is bad input."""
    record = _stats_only_record(tmp_path, torch.ones(3))
    assert check_record(record, "r", tmp_path).sketch is not None
    record["sketch"] = sketch
    with pytest.raises(Malformed, match="sketch must be 128 float64 values in base64, beside stats"):
        check_record(record, "r", tmp_path)


def test_a_sketch_that_overflowed_is_not_written_and_reads_as_none(tmp_path):
    """An fp64 run's values near 1e308 sum past float64 in a bucket: the record keeps its statistics
    without a sketch (before, the reader rejected the whole dump); one written anyway reads as none."""
    record = _stats_only_record(tmp_path, torch.full((300,), 1e308, dtype=torch.float64))
    assert "sketch" not in record and check_record(record, "r", tmp_path).stats is not None
    record = _stats_only_record(tmp_path, torch.ones(3))
    record["sketch"] = encode(np.full(K, math.nan))
    assert check_record(record, "r", tmp_path).sketch is None


def test_a_scalar_and_a_long_vector_keep_their_sketches_and_only_short_indexes_are_cached(tmp_path, monkeypatch):
    """writer._located: index vectors over CACHED_INDEXES are not kept (they would stay for the run's life)."""
    monkeypatch.setattr(writer_module, "CACHED_INDEXES", 4)
    writer_module._located_cached.cache_clear()
    for tensor in (torch.tensor(2.5), torch.randn(5, generator=GEN), torch.randn(2, 3, generator=GEN)):
        assert np.array_equal(check_record(_stats_only_record(tmp_path, tensor), "r", tmp_path).sketch,
                              summary_of(tensor)[1])
    assert writer_module._located_cached.cache_info().currsize == 2  # the scalar's and the [2, 3]'s


def _stats_only_record(folder: Path, tensor: torch.Tensor) -> dict:
    writer = RankWriter(folder, RankCoords(rank=0), stats_only=True)
    writer.add("activation", "x", tensor, Sharding())
    writer.close()
    return writer.records[0].to_dict()
