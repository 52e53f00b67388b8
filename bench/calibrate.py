"""Calibrate compare's thresholds on a real trained checkpoint (SmolLM2-135M, tests/real_checkpoint.py).

Runs the same tokens through transformers and megatron-core under several layouts, in fp32, bf16
and fp64 (the reference), compares each run with transformers' run of the same precision and with
the fp64 reference, and prints, per kind of tensor, the largest relative difference seen: between
the two runs (what the default thresholds must allow) and from each run to the reference (what the
--reference rounding budgets must allow). The thresholds in compare/thresholds.py and
compare/reference.py are set from this table with a margin; README "Verdicts on a real model"
quotes it.

    python bench/calibrate.py [--out DIR] [--mode backward|forward]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from real_checkpoint import build  # noqa: E402

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
    """kind -> (max rel A-B, max rel A-R, max rel B-R)."""
    found: dict = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for line in report.read_text().splitlines()[:-1]:
        row = json.loads(line)
        if not row["metrics"] or row["metrics"]["rel_diff"] is None:
            continue
        values = found[row["kind"]]
        values[0] = max(values[0], row["metrics"]["rel_diff"])
        if row.get("reference"):
            values[1] = max(values[1], row["reference"]["rel_a"] or 0.0)
            values[2] = max(values[2], row["reference"]["rel_b"] or 0.0)
    return found


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
        print(f"\n{'A vs B':34s} {'kind':16s} {'rel A-B':>9s} {'rel A-R':>9s} {'rel B-R':>9s}")
        for a, b in PAIRS:
            report = out / f"{a}--{b}.jsonl"
            subprocess.run(MEGALIGN + ["compare", str(out / a), str(out / b), "--reference", str(out / "hf-fp64"),
                                       "--json", str(report)], stdout=subprocess.DEVNULL)
            for kind, (ab, ar, br) in sorted(worst(report).items()):
                if kind != "input":
                    print(f"{a + ' vs ' + b:34s} {kind:16s} {ab:9.2g} {ar:9.2g} {br:9.2g}")


if __name__ == "__main__":
    main()
