"""What the sketch costs the device statistics' kernel (dump/device_kernels.py): for an activation and
a weight at hidden 1024 and hidden 4096, in bf16 and float32, the median time of (a) torch's .sum()
of the tensor, the memory-bound floor; (b) the statistics kernel alone; (c) the statistics with the
sketch in the same pass, as SummaryBatch runs it; (d) the statistics kernel and the sketch by
torch's ops (sketch.device_sketch, the path where the kernel cannot run); (e) the fused kernel with
its atomic adds spread over other numbers of copies of the buckets than stats.COPIES; (f) the
kernel given a false flag (a #stepped read it skips). Prints each as a ratio to (a), never a time:
one run on one card says only what that card did.

usage: python bench/bench_sketch.py [--reps 20]   (needs a GPU and Triton)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_run import positive  # bench/ is this script's own folder on sys.path

from megalign.dump.device_kernels import reduce_rows
from megalign.dump.sketch import K, device_sketch, rows_and_cols
from megalign.dump.stats import COPIES, ROW

# (name, shape): an activation's [tokens, hidden] and an MLP weight's [ffn, hidden], as bench_trainer's models.
OTHER_COPIES = (1, 8, 128)
SHAPES = [("h1024 activation", (4 * 512, 1024)), ("h1024 weight", (4096, 1024)),
          ("h4096 activation", (2 * 2048, 4096)), ("h4096 weight", (14336, 4096))]


def median_ms(run, reps: int) -> float:
    """The median of `reps` timed calls of `run`, each between two CUDA events, after two untimed
    (compilation, caches)."""
    for _ in range(2):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=positive, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sketch: needs a GPU")
    print(f"{'tensor':<18} {'dtype':<9} {'stats':>7} {'+sketch':>8} {'+torch':>8} "
          + " ".join(f"{f'copies {n}':>10}" for n in OTHER_COPIES) + f" {'skipped':>8}   (each / .sum())")
    for name, shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            flat = x.reshape(-1)
            base, cols = rows_and_cols(shape, [torch.arange(n) for n in shape], x.device)
            table = torch.empty(-(-x.numel() // ROW), 7, device="cuda")
            sketch = torch.zeros(1, COPIES, K, dtype=torch.float64, device="cuda")
            floor = median_ms(lambda: x.sum(), args.reps)
            alone = median_ms(lambda: reduce_rows(flat, table, 0, ROW, None), args.reps)
            fused = median_ms(lambda: reduce_rows(flat, table, 0, ROW, (base, cols, sketch, 0)), args.reps)
            eager = median_ms(lambda: (reduce_rows(flat, table, 0, ROW, None),
                                       device_sketch(flat, base, cols, sketch[0, 0])), args.reps)
            spread = [median_ms(lambda: reduce_rows(flat, table, 0, ROW, (base, cols, other, 0)), args.reps)
                      for other in (torch.zeros(1, n, K, dtype=torch.float64, device="cuda") for n in OTHER_COPIES)]
            thrown = torch.zeros((), dtype=torch.bool, device="cuda")
            skipped = median_ms(lambda: reduce_rows(flat, table, 0, ROW, (base, cols, sketch, 0), thrown), args.reps)
            print(f"{name:<18} {str(dtype).removeprefix('torch.'):<9} {alone / floor:>6.2f}x {fused / floor:>7.2f}x "
                  f"{eager / floor:>7.2f}x " + " ".join(f"{t / floor:>9.2f}x" for t in spread)
                  + f" {skipped / floor:>7.2f}x")


if __name__ == "__main__":
    main()
