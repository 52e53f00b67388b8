"""How fast and how lean `megalign compare` is on big dumps, as ratios only.

Writes two synthetic dumps of about 1.1 GB each with megalign's own RankWriter: A at CP=1 (one
rank), B at CP=2 (two ranks holding zigzag halves, so every tensor is reassembled) with small noise
added. Then, each in a fresh process so that neither inherits the other's memory:

    read      read every file of both dumps once, in 16 MiB blocks (the floor any comparison pays)
    compare   compare_sources(A, B) as `megalign compare` runs it

and prints compare time / read time (goal: under 2x) and the compare process's peak RSS increase
(VmHWM during the comparison minus VmRSS before it) / the largest tensor. Temp files are removed.
With --dumps A B it measures two existing dumps instead (bench/gpu.sh: the 0.5B gradient dumps).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from megalign.alignment.dump.format import DUMP_META, FORMAT, VERSION, RankCoords, write_json_atomic

from megalign.alignment.dump.writer import RankWriter
from megalign.alignment.dump.sharding import Sharding, zigzag_chunks

TENSORS = 17
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
import sys, time
from pathlib import Path
from megalign.alignment.compare.verdict import compare_sources
from megalign.alignment.compare.sources import open_source
from megalign.alignment.compare.thresholds import Thresholds
def status(key):
    line = next(l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024
Path('/proc/self/clear_refs').write_text('5')
before = status('VmRSS')
start = time.perf_counter()
report = compare_sources(open_source(sys.argv[1]), open_source(sys.argv[2]), Thresholds())
elapsed = time.perf_counter() - start
assert sys.argv[3] == "any" or report.summary.compared == int(sys.argv[3]), report.summary
print(elapsed, status('VmHWM') - before)
"""


def write_dumps(root: Path) -> None:
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


def largest_tensor_bytes(*dumps: Path) -> int:
    from megalign.alignment.dump.reader import Dump

    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "float64": 8}
    return max(math.prod(r.shape) * itemsize.get(r.dtype, 4) for d in dumps for _, r in Dump.open(d).records())


def measure(a: Path, b: Path, expected: str) -> dict:
    total = sum(p.stat().st_size for root in (a, b) for p in root.rglob("*.safetensors"))
    read = min(run(_READ, str(a), str(b))[0] for _ in range(2))
    compare_s, peak = run(_COMPARE, str(a), str(b), expected)
    return {"dumps_gib": round(total / 2**30, 2), "compare_over_read": round(compare_s / read, 2),
            "peak_rss_increase_over_largest_tensor": round(peak / largest_tensor_bytes(a, b), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dumps", nargs=2, type=Path, metavar=("A", "B"),
                        help="measure on these two existing dumps instead of the synthetic pair")
    args = parser.parse_args()
    if args.dumps:
        print(json.dumps({"dumps": [str(d) for d in args.dumps], **measure(*args.dumps, "any")}))
        return
    root = Path(tempfile.mkdtemp(prefix="megalign-bench-"))
    try:
        write_dumps(root)
        print(json.dumps({"tensors_per_dump": TENSORS, **measure(root / "a", root / "b", str(TENSORS))}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
