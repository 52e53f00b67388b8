"""The two ways a rank's statistics are taken agree: TensorStats.of (a CPU tensor, in a writing
thread) and device_summary (queued on a device, read back later), here both run on CPU tensors."""

import math

import pytest
import torch

from megalign.dump import stats
from megalign.dump.stats import TensorStats, device_summary

CASES = {
    "normal": torch.randn(5000, generator=torch.Generator().manual_seed(0)),
    "bf16": torch.randn(300, generator=torch.Generator().manual_seed(1)).bfloat16(),
    "nonfinite": torch.tensor([1.0, math.nan, math.inf, -math.inf, -2.0]),
    "nothing finite": torch.tensor([math.nan, math.inf]),
    "token ids": torch.arange(10),
}


@pytest.mark.parametrize("name", CASES)
def test_device_summary_reads_back_as_the_cpu_statistics(name):
    x = CASES[name]
    ours = TensorStats.from_summary(x.numel(), device_summary(x).tolist())
    assert ours.to_dict() == pytest.approx(TensorStats.of(x).to_dict(), rel=1e-6, nan_ok=True)


def test_a_sign_flip_changes_the_summary():
    """The twin: the summary sees what it is fed (a flipped tensor has another sum)."""
    x = CASES["normal"]
    assert device_summary(-x)[0] == pytest.approx(-device_summary(x)[0])
    assert device_summary(-x)[0] != device_summary(x)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu.sh runs it)")
@pytest.mark.parametrize("name", CASES)
def test_on_a_device_the_summary_reads_back_as_the_cpu_statistics(name):
    x = CASES[name]
    ours = TensorStats.from_summary(x.numel(), device_summary(x.cuda()).tolist())
    assert ours.to_dict() == pytest.approx(TensorStats.of(x).to_dict(), rel=1e-5, nan_ok=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu.sh runs it)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_device_the_compiled_summary_reads_back_as_the_cpu_statistics(dtype):
    """Long enough to be compiled (over 16 rows of 4096), with a NaN and an Inf in it."""
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[10], x[99_999] = math.nan, -math.inf
    ours = TensorStats.from_summary(x.numel(), device_summary(x.cuda(), fused=True).tolist())
    assert ours.to_dict() == pytest.approx(TensorStats.of(x).to_dict(), rel=1e-5, nan_ok=True)


def reference(x: torch.Tensor) -> dict:
    """Plain float64 torch over the finite values."""
    flat = x.flatten().double()
    kept = flat[torch.isfinite(flat)]
    some = kept.numel() > 0
    return {"numel": x.numel(), "sum": float(kept.sum()), "sum_sq": float((kept * kept).sum()),
            "abs_sum": float(kept.abs().sum()), "min": float(kept.min()) if some else math.nan,
            "max": float(kept.max()) if some else math.nan, "nan": int(flat.isnan().sum()),
            "inf": int(flat.isinf().sum())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cpu_statistics_in_chunks_are_those_of_the_whole_in_float64(monkeypatch, dtype):
    """Chunks of 1000 (the compiled pass a chunk): a NaN and an Inf in the third chunk only are
    counted and left out of the sums and extremes there, the other chunks summed fast."""
    monkeypatch.setattr(stats, "CHUNK", 1000)
    x = (torch.randn(5500, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    x[2100], x[2500] = math.nan, -math.inf
    assert TensorStats.of(x).to_dict() == pytest.approx(reference(x), rel=1e-12, nan_ok=True)
    for whole in (CASES["nothing finite"], torch.empty(0), CASES["token ids"], torch.tensor([1e200, -3e199])):
        assert TensorStats.of(whole).to_dict() == pytest.approx(reference(whole), rel=1e-12, nan_ok=True)
