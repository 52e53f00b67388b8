"""The two ways a rank's statistics are taken agree: TensorStats.of (a CPU tensor, in a writing
thread) and SummaryBatch (tensors staged side by side on a device, reduced together, read back
later), here both run on CPU tensors, and on a GPU where there is one."""

import math

import pytest
import torch

from megalign.dump import stats
from megalign.dump.stats import SummaryBatch, TensorStats

CASES = {
    "normal": torch.randn(5000, generator=torch.Generator().manual_seed(0)),
    "bf16": torch.randn(300, generator=torch.Generator().manual_seed(1)).bfloat16(),
    "nonfinite": torch.tensor([1.0, math.nan, math.inf, -math.inf, -2.0]),
    "nothing finite": torch.tensor([math.nan, math.inf]),
    "token ids": torch.arange(10),
    "float64": torch.randn(4097, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1e3,
    "empty": torch.empty(0),
}


def summaries(tensors: list[torch.Tensor], rows: int = 8, fused: bool = False) -> list[dict]:
    """Each tensor's statistics through a SummaryBatch of `rows` rows of 4096, read back."""
    batch = SummaryBatch(rows)
    batch.fused = fused
    for x in tensors:
        batch.add(x)
    taken = batch.take().tolist()
    assert batch.take() is None  # taken once
    return [TensorStats.from_summary(x.numel(), row).to_dict() for x, row in zip(tensors, taken, strict=True)]


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
        assert ours == pytest.approx(TensorStats.of(x).to_dict(), rel=1e-5, nan_ok=True)


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
        assert ours == pytest.approx(TensorStats.of(cpu).to_dict(), rel=1e-5, nan_ok=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu.sh runs it)")
def test_on_a_device_a_stats_only_step_never_waits_for_the_device(tmp_path, monkeypatch):
    """The step's thread never waits for the GPU (a wait at each reduction stalled the queue 20 times a
    step): with torch's sync debug mode at "error", stats-only steps of a small model raise nothing,
    staged (step 0) and through the Triton kernel (step 2; compiled in step 1), with a buffer of two
    rows and a read-back every 4 tensors, so that reductions and read-backs happen inside the steps;
    an empty output among them. The dump holds every tensor with its statistics."""
    import megalign
    from megalign.dump import writer

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.empty, self.second = torch.nn.Linear(64, 64), torch.nn.Identity(), torch.nn.Linear(64, 64)

        def forward(self, x):
            self.empty(x[:0])
            return self.second(torch.relu(self.first(x)))

    monkeypatch.setattr(writer, "SUMMARIES_PER_COPY", 4)
    torch.manual_seed(0)
    model, x = Model().cuda(), torch.randn(8, 64, device="cuda")
    with megalign.Dumper(tmp_path / "out", stats_only=True) as dumper:
        dumper.watch(model)
        dumper._writer.summaries = SummaryBatch(rows=2)
        for step in range(3):
            torch.cuda.set_sync_debug_mode("error" if step != 1 else 0)
            try:
                with dumper.step(step):
                    model(x).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            model.zero_grad()
    dump = megalign.open(tmp_path / "out")
    # Each step: 3 outputs, the gradients of the two linears', 4 parameter gradients.
    assert len(dump.names()) == 3 * (3 + 2 + 4)
    stats = {name: dump.shards(kind, name)[0].stats for kind, name in dump.names()}
    assert stats["step2/empty"]["numel"] == 0 and stats["step2/second"]["numel"] == 8 * 64


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
