"""The fast paths of issue 14 keep their meaning: the one-pass metrics against plain float64 torch,
the buffer budget, pairs streamed a window of rows at a time against whole ones, and dump files that
the safetensors package still reads."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch
from compare_fixtures import CP1, CP2, CP2_LOCAL, TP2
from safetensors.torch import load_file

import megalign

from megalign.compare import execution, fused
from megalign.compare.buffers import SMALLEST, BufferPool
from megalign.compare.judge import Rules
from megalign.compare.matching import match_entries
from megalign.compare.metrics import metrics_of, pair_sums, tensor_metrics
from megalign.compare.pipeline import compare_sources
from megalign.compare.records import FAIL, PASS
from megalign.compare.sources import open_source
from megalign.compare.thresholds import Thresholds
from megalign.dump import writer as writer_module
from megalign.dump.format import RankCoords
from megalign.dump.sharding import Sharding
from megalign.dump.pinned import PinnedBuffers
from megalign.dump.stats import TensorStats, summary_of
from megalign.dump.tensorfile import TensorFiles, content_hash, read_into, write_file
from megalign.dump.writer import RankWriter


def reference(x: torch.Tensor, y: torch.Tensor) -> dict:
    a, b = x.double().reshape(-1), y.double().reshape(-1)
    d = (a - b).abs()
    return {"rel_diff": float(((a - b) ** 2).sum() / (a * a + b * b).sum()), "max_abs_diff": float(d.max()),
            "index": int(d.argmax()), "mean_abs_diff": float(d.mean())}


@pytest.mark.parametrize("dtype_a, dtype_b", [(torch.float32, torch.float32), (torch.float64, torch.float32),
                                              (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                              (torch.int64, torch.int64)])
def test_one_pass_metrics_equal_float64_torch(dtype_a, dtype_b):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 100_003, generator=generator) * 50  # odd size: a last partial block and chunk
    y = x + torch.randn(x.shape, generator=generator)
    x, y = x.to(dtype_a), y.to(dtype_b)
    got, want = tensor_metrics(x, y), reference(x, y)
    assert math.isclose(got.rel_diff, want["rel_diff"], rel_tol=1e-9)
    assert got.max_abs_diff == want["max_abs_diff"]  # exact
    assert got.max_abs_index == [want["index"] // x.shape[1], want["index"] % x.shape[1]]
    assert math.isclose(got.mean_abs_diff, want["mean_abs_diff"], rel_tol=1e-9)


def test_the_first_position_of_the_maximum_is_reported():
    x = torch.zeros(50_000)
    y = x.clone()
    y[[7, 20_000, 49_999]] = 2.0  # three ties, in different blocks
    assert tensor_metrics(x, y).max_abs_index == [7]
    assert tensor_metrics(x, x).max_abs_index == [0] and tensor_metrics(x, x).rel_diff == 0.0


def test_windows_of_different_scales_add_up_to_the_whole():
    """Sums scaled by their own range's magnitude (fused.py) merge to the whole's, in either order."""
    x = torch.cat([torch.full((5,), 1e-170, dtype=torch.float64), torch.linspace(1, 2, 5, dtype=torch.float64)])
    y = x.clone()
    y[:5] *= -1  # a sign flip far below where squares underflow: negligible beside the second window
    y[5:] += 1e-3
    whole = tensor_metrics(x, y).rel_diff
    for order in ((0, 5), (5, 0)):
        total = fused.Sums()
        for start in order:
            total.add(pair_sums(x[start:start + 5], y[start:start + 5]), start)
        assert math.isclose(metrics_of(total, [10]).rel_diff, whole, rel_tol=1e-12)
    tiny = tensor_metrics(x[:5] * 1e-30, y[:5] * 1e-30)  # the tiny window alone: its flip is all there is
    assert tiny.rel_diff == 2.0 and tiny.cosine == -1.0


def test_nonfinite_values_are_counted_and_left_out_of_the_sums():
    x = torch.arange(10.0)
    y = x.clone()
    x[3], y[3] = math.nan, math.nan  # same place: not a mismatch
    y[5] = math.inf  # one side only
    m = tensor_metrics(x, y)
    assert (m.nan_a, m.nan_b, m.inf_a, m.inf_b, m.nonfinite_diff) == (1, 1, 0, 1, 1)
    assert m.rel_diff == 0.0 and m.max_abs_diff == 0.0 and m.nonfinite_mismatch
    assert m.mean_abs_diff == 0.0


def test_a_lease_waits_until_its_buffers_fit_the_budget():
    pool = BufferPool(budget=3 * SMALLEST)
    order = []
    with pool.lease(2 * SMALLEST, None) as (big, none):
        assert len(big) >= 2 * SMALLEST and none is None

        def second():
            with pool.lease(2 * SMALLEST, SMALLEST) as buffers:
                order.append("second")
                assert sum(len(b) for b in buffers) <= pool.budget

        waiting = threading.Thread(target=second)
        waiting.start()
        time.sleep(0.2)
        order.append("first done")
    waiting.join(timeout=10)
    assert order == ["first done", "second"]
    with pool.lease(10 * SMALLEST) as (larger,):  # larger than the budget: alone, never a deadlock
        assert len(larger) == 10 * SMALLEST


def test_dump_files_are_safetensors_files(tmp_path):
    tensors = {"0": torch.randn(3, 5), "1": torch.arange(7), "2": torch.randn(4).bfloat16(), "3": torch.tensor(1.5),
               "4": torch.empty(0, 3), "5": torch.tensor([True, False])}
    path = tmp_path / "t.safetensors"
    _, hashes = write_file(path, tensors)
    assert hashes == {key: content_hash(tensor) for key, tensor in tensors.items()}
    assert all(torch.equal(value, tensors[key]) for key, value in load_file(str(path)).items())
    files = TensorFiles()
    for key, tensor in tensors.items():
        location = files.locate(path, key)
        out = torch.empty(location.shape, dtype=location.dtype)
        read_into(location, out)
        assert torch.equal(out, tensor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: bench/gpu.sh runs it")
def test_device_tensors_stream_through_the_pinned_buffers(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"0": torch.randn(1000, 7, generator=generator), "1": torch.arange(5), "2": torch.empty(0, 3),
               "3": torch.randn(333, generator=generator).bfloat16(), "4": torch.tensor(2.5)}
    path = tmp_path / "t.safetensors"
    pinned = PinnedBuffers(piece_bytes=1000)  # many pieces a tensor, the two buffers taking turns
    _, hashes = write_file(path, {key: tensor.cuda() for key, tensor in tensors.items()}, pinned.pieces)
    assert hashes == {key: content_hash(tensor) for key, tensor in tensors.items()}
    assert all(torch.equal(value, tensors[key]) for key, value in load_file(str(path)).items())


def compare(a, b):
    return compare_sources(open_source(a), open_source(b), Thresholds())


@pytest.mark.parametrize("layout", [CP2, TP2])
# Windows of a few rows; or, the rows (256 bytes and more) being larger, runs of the last dim.
@pytest.mark.parametrize("window", [3000, 200])
def test_pairs_streamed_a_few_rows_at_a_time_get_the_metrics_of_the_whole(dump, monkeypatch, layout, window):
    whole = compare(dump(*CP1), dump(*layout))
    monkeypatch.setattr(execution, "STREAM_BYTES", 1)  # every tensor of a megalign dump is streamed
    monkeypatch.setattr(execution, "WINDOW_BYTES", window)  # windows cut CP halves and TP shards
    monkeypatch.setattr(execution, "CHUNK_WINDOWS", 2)  # chunks of two windows, taken by the workers apart
    streamed = compare(dump(*CP1), dump(*layout))
    assert [r.status for r in streamed.rows] == [r.status for r in whole.rows]
    for s, w in zip(streamed.rows, whole.rows):
        if w.metrics is not None and w.logprobs is None:
            assert s.metrics.max_abs_diff == w.metrics.max_abs_diff and s.metrics.max_abs_index == w.metrics.max_abs_index
            assert math.isclose(s.metrics.rel_diff, w.metrics.rel_diff, rel_tol=1e-9, abs_tol=1e-30), s.name


def _one_tensor_dump(path, tensor: torch.Tensor):
    with megalign.Dumper(path) as dumper:
        dumper.add("activation", "w", tensor)
    return open_source(path)


def test_a_big_pair_in_chunks_gets_the_sums_of_the_whole_and_the_first_worst_position(tmp_path, monkeypatch):
    """A pair cut into chunks that several workers take: the same sums as whole, the worst element
    found in the last chunk at its position in the whole, and the first of two equal worst ones kept.
    Twin of the agreement below: the one element changed is what fails."""
    x = torch.randn(4000, 64, generator=torch.Generator().manual_seed(0))
    x[3900, 5] = x[3950, 7] = 0.0
    y = x.clone()
    y[3900, 5] = y[3950, 7] = 1.0  # in the last chunks, exactly as far off
    monkeypatch.setattr(execution, "STREAM_BYTES", 1)
    monkeypatch.setattr(execution, "WINDOW_BYTES", 4 * 64 * 10)  # 10 rows a window, 20 a chunk: 200 chunks
    monkeypatch.setattr(execution, "CHUNK_WINDOWS", 2)
    a, b = _one_tensor_dump(tmp_path / "a", x), _one_tensor_dump(tmp_path / "b", y)
    comparison = execution.Execution(a, b, match_entries(a, b), Rules(Thresholds()))
    assert len(comparison.chunks(comparison.pairs[0])) == 200
    (row,) = compare_sources(a, b, Thresholds(), workers=4).rows
    want = reference(x, y)
    assert want["index"] == 3900 * 64 + 5
    assert row.status == FAIL and row.metrics.max_abs_index == [3900, 5]
    assert math.isclose(row.metrics.rel_diff, want["rel_diff"], rel_tol=1e-9)
    (same,) = compare_sources(a, _one_tensor_dump(tmp_path / "c", x.clone()), Thresholds(), workers=4).rows
    assert same.status == PASS and same.metrics.max_abs_diff == 0


def test_a_pair_whose_rows_are_larger_than_a_window_is_read_in_boxes_of_a_deeper_dim(tmp_path, monkeypatch):
    """Attention weights [batch, heads, seq, seq] of two rows: read by rows of dim 0, one worker
    leased half the tensor at once. Windows of 4 heads within one batch row: the whole's sums and
    worst position, the differing element found in the last box."""
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[1, 7, 5, 4] += 1.0
    monkeypatch.setattr(execution, "STREAM_BYTES", 1)
    monkeypatch.setattr(execution, "WINDOW_BYTES", 4 * 36 * 4)  # four heads' [6, 6]
    monkeypatch.setattr(execution, "CHUNK_WINDOWS", 1)
    a, b = _one_tensor_dump(tmp_path / "a", x), _one_tensor_dump(tmp_path / "b", y)
    comparison = execution.Execution(a, b, match_entries(a, b), Rules(Thresholds()))
    assert comparison.windows(comparison.pairs[0]) == [((0, 1), (0, 4)), ((0, 1), (4, 8)), ((1, 2), (0, 4)),
                                                        ((1, 2), (4, 8))]
    assert comparison.lease_bytes(comparison.pairs[0]) == 2 * 4 * 36 * 4
    (row,) = compare_sources(a, b, Thresholds(), workers=3).rows
    assert row.status == FAIL and row.metrics.max_abs_index == [1, 7, 5, 4]
    assert math.isclose(row.metrics.rel_diff, reference(x, y)["rel_diff"], rel_tol=1e-9)


def test_a_divergence_is_caught_when_streamed(dump, monkeypatch):
    """Twin: CP=2 with the loss divided by the local token count fails streamed as it does whole."""
    monkeypatch.setattr(execution, "STREAM_BYTES", 1)
    monkeypatch.setattr(execution, "WINDOW_BYTES", 3000)
    report = compare(dump(*CP1), dump(*CP2_LOCAL))
    assert not report.summary.ok and report.summary.first_failure_by_kind.get("param_grad")


@pytest.mark.parametrize("threads", [1, 3])  # one on a machine of 7 cores or fewer (CI), more on bigger ones
def test_the_writer_threads_dump_values_as_they_were_added_and_raise_their_errors(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(writer_module, "WRITE_THREADS", threads)
    writer = RankWriter(tmp_path / "ok", RankCoords(rank=0), flush_bytes=100)  # a file every two tensors
    tensors = [torch.randn(7, 3) for _ in range(5)]
    for i, tensor in enumerate(tensors):
        writer.add("activation", f"t{i}", tensor, Sharding())
    expected = [t.clone() for t in tensors]
    tensors[0].zero_()  # changed after add: the dump keeps the value it had
    writer.close()
    files = TensorFiles()
    for record, want in zip(writer.records, expected):
        location = files.locate(writer.dir / record.file, record.key)
        got = torch.empty(location.shape, dtype=location.dtype)
        read_into(location, got)
        assert torch.equal(got, want) and record.hash == content_hash(want)
    assert len({r.file for r in writer.records}) == 3

    broken = RankWriter(tmp_path / "broken", RankCoords(rank=0))
    broken.dir.rmdir()
    broken.dir.write_text("not a folder")  # the file cannot be created
    broken.add("activation", "t", torch.ones(3), Sharding())
    with pytest.raises(RuntimeError, match="writing the dump into .* failed"):
        broken.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: bench/gpu.sh runs it"))])
def test_stats_only_records_the_values_as_they_were_added_on_each_device(tmp_path, monkeypatch, device):
    """On a device, summaries read back a batch at a time (three batches here, the last at close);
    small tensors are summed on the host."""
    monkeypatch.setattr(writer_module, "SUMMARIES_PER_COPY", 4)
    writer = RankWriter(tmp_path / device, RankCoords(rank=0), stats_only=True)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 300, generator=generator) * (i + 1) for i in range(9)]
    tensors += [torch.tensor([1.0, math.nan, math.inf]), torch.randn(40, generator=generator).bfloat16()]
    expected = [TensorStats.of(t) for t in tensors]
    sketches = [summary_of(t)[1] for t in tensors]
    for i, tensor in enumerate(tensors):
        on_device = tensor.to(device)
        writer.add("activation", f"t{i}", on_device, Sharding())
        on_device.zero_()  # changed after add: the statistics are of the value it had
    writer.close()
    for record, want, sketch in zip(writer.records, expected, sketches, strict=True):
        assert record.stats.to_dict() == pytest.approx(want.to_dict(), rel=1e-5, nan_ok=True), record.name
        assert np.allclose(record.sketch, sketch, rtol=1e-12, atol=1e-12 * np.abs(sketch).max()), record.name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: bench/gpu.sh runs it")
def test_device_tensors_are_written_as_they_were_added_copied_on_the_device_or_the_host(tmp_path):
    """Tensors are copied on the device, two at a time in the room left for copies there: the third
    waits for the first two, which are written first though their file is not full; one larger than
    the room goes through pinned host memory. All write the value the tensor had when added."""
    writer = RankWriter(tmp_path / "device", RankCoords(rank=0), flush_bytes=10_000)
    writer._device_room = 3000
    tensors = [torch.randn(30, 10, device="cuda") for _ in range(5)] + [torch.randn(40, 25, device="cuda")]
    expected = [t.cpu() for t in tensors]
    for i, tensor in enumerate(tensors):
        writer.add("activation", f"t{i}", tensor, Sharding())
        tensor.zero_()
    writer.close()
    files = TensorFiles()
    for record, want in zip(writer.records, expected, strict=True):
        location = files.locate(writer.dir / record.file, record.key)
        got = torch.empty(location.shape, dtype=location.dtype)
        read_into(location, got)
        assert torch.equal(got, want) and record.hash == content_hash(want)
    assert len({record.file for record in writer.records}) == 3  # [t0 t1] [t2 t3] [t4 t5]
    assert writer._on_device == 0  # every copy on the device released once written
