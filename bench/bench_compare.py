"""How fast and how lean `megalign compare` is, as ratios only, on three pairs of dumps:

    synthetic   two dumps of 17 large tensors (1.1 GB each) written with megalign's own RankWriter:
                A at CP=1, B at CP=2 (zigzag halves, so every tensor is reassembled), small noise added
    real        backward runs of the real SmolLM2-135M checkpoint (tests/real_checkpoint.py) at TP=1
                and TP=3: 921 tensors of every kind, TP shards and replicas
    llama-cp    backward runs of configs/llama-0.1b.yaml at CP=1 and CP=2: CP halves, and every
                parameter gradient a replica on both CP ranks

For each pair, each in a fresh process so that none inherits another's memory:

    read      read every file of both dumps once, in 16 MiB blocks, on one core (the floor any
              comparison pays; the files are in the page cache, as they are after a run)
    compare   compare_sources(A, B) as `megalign compare` runs it, on one core (pinned, one
              worker) and on all cores

Each is run three times and the fastest counts (the least disturbed run; read likewise).
and prints compare time / read time (goals: 2x on real dumps, 1.5x on the synthetic pair), and the
compare process's peak RSS increase (VmHWM during the comparison minus VmRSS before it) / the
largest tensor (goal: 2x). The compare process loads its compiled kernels before the clock starts,
as it imports torch before; that one-time load is printed too, as a ratio to the same read.

usage: python bench/bench_compare.py [--pairs synthetic real llama-cp] [--dumps A B [--once]] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from megalign.dump.format import DUMP_META, FORMAT, VERSION, RankCoords, write_json_atomic
from megalign.dump.layout import zigzag_chunks
from megalign.dump.sharding import Sharding
from megalign.dump.writer import RankWriter

ROOT = Path(__file__).resolve().parents[1]
TENSORS = 17
RUNS = 3
SHAPE = (4096, 1, 4096)  # [s, b, h] fp32: 64 MiB each, 17 of them per dump
CP = 2

_READ = """
import sys, time
from pathlib import Path
files = [p for root in sys.argv[1:] for p in sorted(Path(root).rglob('*.safetensors'))]
buffer = bytearray(16 << 20)
start = time.perf_counter()
for path in files:
    with open(path, 'rb', buffering=0) as f:
        while f.readinto(buffer):
            pass
print(time.perf_counter() - start)
"""

# ru_maxrss survives exec (a child starts with its parent's high-water mark), so the child reads
# the kernel's own high-water mark, VmHWM, after resetting it to the current RSS (clear_refs 5).
_COMPARE = """
import os, sys, time
from pathlib import Path
from megalign.compare.pipeline import compare_sources
from megalign.compare.sources import open_source
from megalign.compare.thresholds import Thresholds
from megalign.compare.fused import load_kernels
a, b, expected, cores = sys.argv[1:5]
if cores == "1":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
start = time.perf_counter()
load_kernels()
kernels = time.perf_counter() - start
def status(key):
    line = next(l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024
Path('/proc/self/clear_refs').write_text('5')
before = status('VmRSS')
start = time.perf_counter()
report = compare_sources(open_source(a), open_source(b), Thresholds(), workers=len(os.sched_getaffinity(0)))
elapsed = time.perf_counter() - start
assert expected == "any" or report.summary.compared == int(expected), report.summary
print(elapsed, status('VmHWM') - before, kernels)
"""


def write_dumps(root: Path) -> None:
    """The synthetic pair, in root/a and root/b."""
    generator = torch.Generator().manual_seed(0)
    single = RankWriter(root / "a", RankCoords(rank=0))
    halves = [RankWriter(root / "b", RankCoords(rank=r, cp_rank=r)) for r in range(CP)]
    for index in range(TENSORS):
        full = torch.randn(SHAPE, generator=generator)
        name = f"decoder.layers.{index}"
        single.add("activation", name, full, Sharding(seq_dim=0), layer=index)
        noisy = full + 1e-7 * torch.randn(SHAPE, generator=generator)
        chunks = noisy.chunk(2 * CP, dim=0)
        for rank, writer in enumerate(halves):
            first, second = zigzag_chunks(rank, CP)
            writer.add("activation", name, torch.cat([chunks[first], chunks[second]]), Sharding(seq_dim=0),
                       layer=index)
        del full, noisy, chunks
    for writer in (single, *halves):
        writer.close()
    for name, cp in (("a", 1), ("b", CP)):
        write_json_atomic(root / name / DUMP_META, {
            "format": FORMAT, "version": VERSION, "stack": "synthetic", "mode": "forward", "dtype": "fp32",
            "layout": {"tp": 1, "pp": 1, "cp": cp}, "world_size": cp})


def run(script: str, *args: str) -> list[float]:
    out = subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True, text=True)
    return [float(v) for v in out.stdout.split()]


def megalign(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "megalign", *args, "--overwrite"], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"megalign {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def real_dumps(root: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from real_checkpoint import build

    checkpoint = build()
    for tp in ("1", "3"):
        megalign("backward", "--hf", str(checkpoint), "--tokens", str(checkpoint / "tokens.json"), "--seq-len", "36",
                 "--tp", tp, "--out", str(root / f"real-tp{tp}"))
    return root / "real-tp1", root / "real-tp3"


def llama_dumps(root: Path) -> tuple[Path, Path]:
    for cp in ("1", "2"):
        megalign("backward", "--config", str(ROOT / "configs" / "llama-0.1b.yaml"), "--cp", cp,
                 "--out", str(root / f"llama-cp{cp}"))
    return root / "llama-cp1", root / "llama-cp2"


def largest_tensor_bytes(*dumps: Path) -> int:
    from megalign.dump.reader import Dump

    return max(math.prod(r.shape) * getattr(torch, r.dtype).itemsize for d in dumps for _, r in Dump.open(d).records())


def measure(a: Path, b: Path, expected: str = "any", once: bool = False) -> dict:
    """`once`: one run of the read and of compare on all cores, for pairs of tens of GiB."""
    runs = 1 if once else RUNS
    total = sum(p.stat().st_size for root in (a, b) for p in root.rglob("*.safetensors"))
    read = min(run(_READ, str(a), str(b))[0] for _ in range(runs))
    # The fastest of three runs of each (the least disturbed: this machine is shared), and its memory.
    one = {} if once else {"compare_over_read_1_core": round(
        min(run(_COMPARE, str(a), str(b), expected, "1")[0] for _ in range(runs)) / read, 2)}
    every, peak, kernels = min(run(_COMPARE, str(a), str(b), expected, "all") for _ in range(runs))
    return {"dumps_gib": round(total / 2**30, 2), "read_s": round(read, 2), "compare_s": round(every, 2), **one,
            f"compare_over_read_{os.cpu_count()}_cores": round(every / read, 2),
            "peak_rss_increase_over_largest_tensor": round(peak / largest_tensor_bytes(a, b), 2),
            "kernel_load_over_read": round(kernels / read, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", choices=("synthetic", "real", "llama-cp"),
                        default=["synthetic", "real", "llama-cp"])
    parser.add_argument("--dumps", nargs=2, type=Path, metavar=("A", "B"),
                        help="measure these two existing dumps instead (bench/gpu.sh: the 0.5B gradient dumps)")
    parser.add_argument("--once", action="store_true",
                        help="with --dumps: one run of each, all cores only (bench/gpu.sh's scale stage)")
    parser.add_argument("--keep", type=Path, help="write the dumps here and keep them (default: a temp folder)")
    args = parser.parse_args()
    if args.dumps:
        print(json.dumps({"dumps": [str(d) for d in args.dumps], **measure(*args.dumps, once=args.once)}))
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="megalign-bench-"))
    try:
        for pair in args.pairs:
            if pair == "synthetic":
                write_dumps(root / "synthetic")
                figures = measure(root / "synthetic" / "a", root / "synthetic" / "b", str(TENSORS))
                shutil.rmtree(root / "synthetic")
            else:
                a, b = real_dumps(root) if pair == "real" else llama_dumps(root)
                figures = measure(a, b)
            print(json.dumps({"pair": pair, **figures}), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
