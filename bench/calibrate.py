"""Calibrate compare's thresholds on a real trained checkpoint (SmolLM2-135M, tests/real_checkpoint.py).

Runs the same tokens through transformers and megatron-core under several layouts, in fp32, bf16
and fp64 (the reference), compares each run with transformers' run of the same precision and with
the fp64 reference, and prints, per kind of tensor, the largest relative difference seen: between
the two runs (what the default thresholds must allow) and from each run to the reference (what the
--reference rounding budgets must allow), and the largest deviation of the norm ratio B/A from 1
(and of the sum ratio where scale.py compares sums), alone and times sqrt(elements): what the scale
check's FLOOR and SPREAD must allow; and the deviation of the median norm ratio of the kind: what its
WHOLE_TOLERANCE must allow. The thresholds in compare/thresholds.py, compare/reference.py
and compare/scale.py are set from this table with a margin; README "Verdicts on a real model"
quotes it.

    python bench/calibrate.py [--out DIR] [--mode backward|forward]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from real_checkpoint import build  # noqa: E402

from megalign.compare.scale import deviation, ratios  # noqa: E402

MEGALIGN = [sys.executable, "-m", "megalign"]
SEQ_LEN = "36"  # a multiple of 2*CP for CP=2; TP=3 divides the model's 9 heads and 3 groups
RUNS = {
    "hf-fp32": ["--stack", "hf"], "hf-bf16": ["--stack", "hf", "--dtype", "bf16"],
    "hf-fp64": ["--stack", "hf", "--dtype", "fp64"],
    "mcore-cp1": [], "mcore-cp2": ["--cp", "2"], "mcore-tp3": ["--tp", "3"], "mcore-pp2": ["--pp", "2"],
    "mcore-tp3-bf16": ["--tp", "3", "--dtype", "bf16"], "mcore-cp2-bf16": ["--cp", "2", "--dtype", "bf16"],
}
# (A, B): each is compared as A vs B, and with --reference hf-fp64.
PAIRS = [("hf-fp32", "mcore-cp1"), ("hf-fp32", "mcore-cp2"), ("hf-fp32", "mcore-tp3"), ("hf-fp32", "mcore-pp2"),
         ("mcore-cp1", "mcore-tp3"), ("hf-bf16", "mcore-tp3-bf16"), ("hf-bf16", "mcore-cp2-bf16"),
         ("hf-fp32", "hf-bf16")]


def run(name: str, mode: str, checkpoint: Path, out: Path) -> None:
    if (out / name / "dump.json").is_file():
        return
    args = MEGALIGN + [mode, "--hf", str(checkpoint), "--tokens", str(checkpoint / "tokens.json"),
                       "--seq-len", SEQ_LEN, "--out", str(out / name), *RUNS[name]]
    print(f"run {name}", flush=True)
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


def worst(report: Path) -> dict:
    """kind -> max of (rel A-B, rel A-R, rel B-R, norm-ratio deviation, that times sqrt(n), sum-ratio deviation),
    and the deviation of the kind's median norm ratio (scale.check_kinds)."""
    found: dict = collections.defaultdict(lambda: [0.0] * 6)
    norm_ratios: dict = collections.defaultdict(list)
    for line in report.read_text().splitlines()[:-1]:
        row = json.loads(line)
        m = row["metrics"]
        if not m or m["rel_diff"] is None:
            continue
        n = math.prod(row["shape_a"])
        norm_ratio, sum_ratio = ratios(n, (m["norm_a"], m["norm_b"]), (m["sum_a"], m["sum_b"]))
        reference = row.get("reference") or {}
        seen = (m["rel_diff"], reference.get("rel_a") or 0.0, reference.get("rel_b") or 0.0, deviation(norm_ratio),
                deviation(norm_ratio) * math.sqrt(n), deviation(sum_ratio) if sum_ratio is not None else 0.0)
        found[row["kind"]] = [max(pair) for pair in zip(found[row["kind"]], seen)]
        norm_ratios[row["kind"]].append(norm_ratio)
    return {kind: figures + [deviation(statistics.median(norm_ratios[kind]))] for kind, figures in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="keep the dumps here (default: a temporary folder)")
    parser.add_argument("--mode", default="backward", choices=("forward", "backward"))
    args = parser.parse_args()
    checkpoint = build()
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        for name in RUNS:
            run(name, args.mode, checkpoint, out)
        print(f"\n{'A vs B':34s} {'kind':16s} {'rel A-B':>9s} {'rel A-R':>9s} {'rel B-R':>9s} {'norm dev':>9s} "
              f"{'dev·√n':>9s} {'sum dev':>9s} {'median dev':>10s}")
        for a, b in PAIRS:
            report = out / f"{a}--{b}.jsonl"
            subprocess.run(MEGALIGN + ["compare", str(out / a), str(out / b), "--reference", str(out / "hf-fp64"),
                                       "--json", str(report)], stdout=subprocess.DEVNULL)
            for kind, figures in sorted(worst(report).items()):
                if kind != "input":
                    print(f"{a + ' vs ' + b:34s} {kind:16s} " + " ".join(f"{x:9.2g}" for x in figures))


if __name__ == "__main__":
    main()
