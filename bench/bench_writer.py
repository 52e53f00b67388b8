"""How fast the dump writer lands a parameter-gradient-shaped dump, by the number of writing threads:
ratios to one plain sequential write of as many bytes, from one run (the fastest of three each).

The tensors have a 0.5B Qwen2's gradient sizes (one 151936x896 embedding, then the layers' matrices
and norms: 1.86 GiB). `stable` tensors are written from where they are (parameter gradients: on a
GPU, streamed through two pinned buffers), the others copied first (activations: into pinned memory
on a GPU, a clone on the CPU). writer.WRITE_THREADS picks the count from the cores; this sets it.

usage: python bench/bench_writer.py [--device cuda] [--threads 1 2 4 8]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from bench_run import positive, write_seconds  # bench/ is this script's own folder on sys.path

from megalign.dump import writer
from megalign.dump.format import RankCoords
from megalign.dump.sharding import Sharding

SIZES = [151936 * 896] + [896 * 4864] * 72 + [896 * 896] * 48 + [896 * 128] * 96 + [896] * 120
RUNS = 3


def dump(tensors: list[torch.Tensor], threads: int, stable: bool, folder: Path) -> float:
    writer.WRITE_THREADS = threads
    root = Path(tempfile.mkdtemp(dir=folder))
    try:
        start = time.perf_counter()
        rank = writer.RankWriter(root, RankCoords(rank=0))
        for i, tensor in enumerate(tensors):
            rank.add("param_grad", f"p{i}", tensor, Sharding(), stable=stable)
        rank.close()
        return time.perf_counter() - start
    finally:
        shutil.rmtree(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=positive, nargs="+", default=[1, 2, 4, 8],
                        help="writing thread counts to time, each against the same sequential write")
    args = parser.parse_args()
    folder = Path(tempfile.gettempdir())
    tensors = [torch.randn(n, device=args.device) for n in SIZES]
    size = sum(t.numel() * t.element_size() for t in tensors)
    base = write_seconds(folder, size, RUNS)
    print(f"dump writer, {size / 2**30:.2f} GiB of gradient-shaped tensors on {args.device}; "
          f"dump time / one sequential write of as many bytes:")
    for stable in (True, False):
        for threads in args.threads:
            seconds = min(dump(tensors, threads, stable, folder) for _ in range(RUNS))
            print(f"  {'stable (written from place)' if stable else 'copied first':28}  "
                  f"{threads} thread{'s' if threads > 1 else ' '}: {seconds / base:.2f}x")


if __name__ == "__main__":
    main()
