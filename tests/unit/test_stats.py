"""The two ways a rank's statistics are taken agree: TensorStats.of (a CPU tensor, in a writing
thread) and device_summary (queued on a device, read back later), here both run on CPU tensors."""

import math

import pytest
import torch

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
