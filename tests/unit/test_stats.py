"""The two ways a rank's statistics are taken agree: TensorStats.of (a CPU tensor, in a writing
thread) and SummaryBatch (tensors staged side by side on a device, reduced together, read back
later), here both run on CPU tensors, and on a GPU where there is one; SummaryBatch's Triton kernel
gives host_summary's statistics and sketch wherever it runs (a GPU, or Triton's interpreter)."""

import math
import os
import warnings
from typing import Optional

import numpy as np
import pytest
import torch

from megalign.dump import stats
from megalign.dump.sketch import K, rows_and_cols
from megalign.dump.stats import SUMMARY, SummaryBatch, TensorStats, host_summary

CASES = {
    "normal": torch.randn(5000, generator=torch.Generator().manual_seed(0)),
    "bf16": torch.randn(300, generator=torch.Generator().manual_seed(1)).bfloat16(),
    "nonfinite": torch.tensor([1.0, math.nan, math.inf, -math.inf, -2.0]),
    "nothing finite": torch.tensor([math.nan, math.inf]),
    "token ids": torch.arange(10),
    "float64": torch.randn(4097, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1e3,
    "empty": torch.empty(0),
}


def whole(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's elements' positions where x is the whole tensor (sketch.rows_and_cols)."""
    return rows_and_cols(tuple(x.shape), [torch.arange(n) for n in x.shape], x.device)


def summaries(tensors: list[torch.Tensor], rows: int = 8, fused: bool = False, located: list = (),
              keep: Optional[torch.Tensor] = None) -> list[dict]:
    """Each tensor's statistics through a SummaryBatch of `rows` rows of 4096, read back, and its
    sketch (`sketch`), each at its `located` positions (else as the whole), each added with `keep`."""
    batch = SummaryBatch(rows)
    batch.fused = fused
    for x, where in zip(tensors, [*located, *map(whole, tensors[len(located):])], strict=True):
        batch.add(x, *where, keep)
    taken = batch.take().cpu()
    assert batch.take() is None and taken.shape[1] == SUMMARY + K  # taken once
    return [{**TensorStats.from_summary(x.numel(), row[:SUMMARY].tolist()).to_dict(), "sketch": row[SUMMARY:].numpy()}
            for x, row in zip(tensors, taken, strict=True)]


def stats_of(summary: dict) -> dict:
    return {name: value for name, value in summary.items() if name != "sketch"}


def test_tensors_summarised_together_read_back_as_each_ones_cpu_statistics():
    """Side by side in one buffer, across a full buffer (3 rows of 4096 each, in a buffer of 8: the
    third is reduced after the first two, in rows a reduced tensor left behind), alone where float64,
    in pieces of a buffer each where larger (its extremes, a NaN and an Inf in its second piece)."""
    big = [torch.randn(3 * 4096 - 5, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    big[1][7], big[2][-1] = math.nan, -math.inf
    huge = torch.randn(9 * 4096, generator=torch.Generator().manual_seed(9)).bfloat16()
    huge[8 * 4096 + 1], huge[8 * 4096 + 2], huge[-1], huge[-2] = 50, -50, math.nan, math.inf
    tensors = [*CASES.values(), *big, huge, CASES["nonfinite"]]
    for ours, x in zip(summaries(tensors), tensors):
        assert stats_of(ours) == pytest.approx(TensorStats.of(x).to_dict(), rel=1e-5, nan_ok=True)
        host = host_summary(x, *whole(x))[1]
        assert np.allclose(ours["sketch"], host, rtol=1e-12, atol=1e-12 * np.abs(host).max())


def test_a_sign_flip_changes_the_summary():
    """The twin: the summary sees what it is fed (a flipped tensor has another sum)."""
    x = CASES["normal"]
    ours, flipped = summaries([x, -x])
    assert flipped["sum"] == pytest.approx(-ours["sum"]) and flipped["sum"] != ours["sum"]
    assert (flipped["min"], flipped["max"]) == (-ours["max"], -ours["min"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu.sh runs it)")
@pytest.mark.parametrize("fused", [False, True])
def test_on_a_device_the_summaries_read_back_as_the_cpu_statistics(fused):
    """Staged, and reduced where they lie by the Triton kernel, with a NaN and an Inf in a bf16 tensor;
    one larger than the buffer (or the kernel's table) right after an empty one."""
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[10], x[99_999] = math.nan, -math.inf
    larger = torch.randn(300_001, generator=torch.Generator().manual_seed(4))  # 74 rows: in two pieces
    larger[-1] = math.nan
    tensors = [*CASES.values(), larger, x, *CASES.values()]
    for ours, cpu in zip(summaries([t.cuda() for t in tensors], rows=64, fused=fused), tensors):
        assert stats_of(ours) == pytest.approx(TensorStats.of(cpu).to_dict(), rel=1e-5, nan_ok=True)
        host = host_summary(cpu, *whole(cpu))[1]
        assert np.allclose(ours["sketch"], host, rtol=1e-12, atol=1e-12 * np.abs(host).max())


def kernel_runs() -> bool:
    """Whether the Triton kernel runs here: a GPU with Triton, or Triton's interpreter on a CPU."""
    try:
        import triton  # noqa: F401 - only whether it imports
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def shard(dtype: torch.dtype, rows: int, width: int, whole: tuple[int, int], seed: int) -> tuple:
    """(a [rows, width] shard of a `whole` matrix, the whole's shape, its rows' and columns' positions
    there, out of order as a TP or CP piece's may lie), with a NaN, an Inf and a value 1e6 below the
    largest of its row."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=gen) * 1e3).to(dtype)
    x[0, 1], x[-1, -2], x[-1, 3] = math.nan, -math.inf, 1e-3
    return x, whole, [torch.randperm(whole[0], generator=gen)[:rows], torch.randperm(whole[1], generator=gen)[:width]]


@pytest.mark.skipif(not kernel_runs(), reason="needs Triton: a GPU, or TRITON_INTERPRET=1 (bench/gpu.sh runs it)")
def test_a_first_step_takes_the_kernel_once_enough_elements_came(monkeypatch):
    """Not fused (a run's first step), a tensor goes through the kernel once FUSED_AFTER elements have
    been added, not before. Seen through a false keep flag, which only the kernel honours (it reads
    the tensor as NaN); the staged way sums it whatever the flag."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.arange(6000, dtype=torch.float32, device=device)
    for after, kernel in ((1 << 40, False), (5000, True)):
        monkeypatch.setattr(stats, "FUSED_AFTER", after)
        (summary,) = summaries([x], keep=torch.tensor(False, device=device))
        assert summary["nan"] == (x.numel() if kernel else 0)


@pytest.mark.skipif(not kernel_runs(), reason="needs Triton: a GPU, or TRITON_INTERPRET=1 (bench/gpu.sh runs it)")
def test_the_triton_kernel_gives_the_hosts_statistics_and_sketch():
    """Fused, every tensor through the kernel (no fallback warning): rows of 4096 a tensor does not
    fill, shards at columns out of order as wide as a row or wider (a row's elements in two of its
    rows) and narrower (in many), float32, bfloat16 and float16, empty, one element and a scalar;
    its statistics and sketch are host_summary's at the same positions, the sketch to float64's
    summation order; added with a true flag, the same, with a false one (a record to be thrown away),
    skipped: nothing but NaN, no sketch. The twin: the same values one column further on sketch
    otherwise."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = [shard(torch.float32, 2, 4100, (5, 9000), 0), shard(torch.bfloat16, 3, 4096, (3, 4096), 1),
             shard(torch.float16, 7, 300, (9, 600), 2), (torch.empty(0, 5), (0, 5), [torch.arange(0), torch.arange(5)]),
             (torch.tensor([3.0]), (9,), [torch.tensor([7])]), (torch.tensor(2.5), (), [])]
    tensors = [x.to(device) for x, _, _ in cases]
    located = [rows_and_cols(shape, where, device) for _, shape, where in cases]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel that failed would be staged, with a warning
        ours = summaries(tensors, fused=True, located=located)
        kept, skipped = (summaries(tensors[:3], fused=True, located=located[:3],
                                   keep=torch.tensor(flag, device=device)) for flag in (True, False))
    for summary, thrown, alone, x in zip(kept, skipped, ours, tensors):
        assert np.allclose(summary["sketch"], alone["sketch"], rtol=1e-12, atol=0)
        assert (thrown["nan"], thrown["sum"], np.abs(thrown["sketch"]).max()) == (x.numel(), 0.0, 0.0)
    for summary, (x, _, _), where in zip(ours, cases, located, strict=True):
        host_stats, host = host_summary(x, *(w.cpu() for w in where))
        assert stats_of(summary) == pytest.approx(host_stats.to_dict(), rel=1e-5, nan_ok=True)
        assert np.allclose(summary["sketch"], host, rtol=1e-12, atol=1e-12 * np.abs(host).max()), x.dtype
    x, shape, (rows, cols) = cases[0]
    moved = summaries(tensors[:1], fused=True, located=[rows_and_cols(shape, [rows, cols + 1], device)])[0]
    assert not np.allclose(moved["sketch"], ours[0]["sketch"], rtol=1e-3)
