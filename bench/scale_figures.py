"""The scale stage's figures (bench/gpu.sh STAGE=scale), from what its runs left behind.

    python bench/scale_figures.py SCALE_DIR WALLS BENCH_COMPARE_LOG

SCALE_DIR holds the dumps bf16, fp32 and bf16-stats (their dump.json: rank 0's start_s, weights_s
and elapsed_s); WALLS the wall time of each step (gpu.sh's expect); BENCH_COMPARE_LOG the json line
of `bench_compare.py --dumps bf16 fp32 --once`. Prints each figure against its goal (issue 23).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from megalign.dump.reader import Dump


def main(scale: Path, walls_file: Path, bench_log: Path) -> None:
    walls = dict(line.split() for line in walls_file.read_text().splitlines())
    wall = {name: float(walls[f"scale-{name}"]) for name in
            ("bwd-bf16", "bwd-fp32", "bwd-bf16-stats-only", "compare-bf16-vs-fp32")}
    meta = {name: json.loads((scale / name / "dump.json").read_text()) for name in ("bf16", "fp32", "bf16-stats")}
    params = sum(math.prod(record.shape) for _, record in Dump.open(scale / "fp32").records()
                 if record.kind == "param_grad")
    bench = json.loads(bench_log.read_text().strip().splitlines()[-1])
    verdict = wall["bwd-bf16"] + wall["bwd-fp32"] + wall["compare-bf16-vs-fp32"]
    rows = [
        ("parameters", f"{params / 1e9:.2f}B", ""),
        *[(f"seeded weights, {name} run: s per billion parameters", f"{meta[name]['weights_s'] / params * 1e9:.2f}",
           "<= 1") for name in ("bf16", "fp32")],
        *[(f"rank start (imports), {name} run: s", f"{meta[name]['start_s']:.1f}", "<= 8")
          for name in ("bf16", "fp32")],
        ("bf16-vs-fp32 verdict: both full-dump backward runs + compare, wall s",
         f"{verdict:.1f} ({wall['bwd-bf16']:.1f} + {wall['bwd-fp32']:.1f} + {wall['compare-bf16-vs-fp32']:.1f})",
         "<= 60"),
        ("compare / reading both dumps once (all cores)",
         f"{next(v for k, v in bench.items() if k.startswith('compare_over_read_'))}x "
         f"({bench['compare_s']} s / {bench['read_s']} s, {bench['dumps_gib']} GiB)", "<= 2x"),
        ("compare peak RSS increase / largest tensor", f"{bench['peak_rss_increase_over_largest_tensor']}x", "<= 2x"),
        ("bf16 backward, full dump / stats-only (workers' elapsed_s)",
         f"{meta['bf16']['elapsed_s'] / meta['bf16-stats']['elapsed_s']:.2f}x", ""),
        ("stats-only run, wall s", f"{wall['bwd-bf16-stats-only']:.1f}", ""),
    ]
    width = max(len(row[0]) for row in rows)
    for what, value, goal in rows:
        print(f"{what:<{width}}  {value}" + (f"  (goal {goal})" if goal else ""))


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))
