"""Calibrate compare's tolerances on a real trained checkpoint (SmolLM2-135M, tests/real_checkpoint.py),
over many texts and layouts, and check them on texts they were not fitted on.

Each batch of four texts of tests/texts.py runs through transformers (fp32, bf16, and fp64 as the
reference) and megatron-core at TP=3, CP=2, TP=3 with sequence parallelism, PP=2 and packed rows at
CP=2, in fp32 and bf16. Each megatron-core run is compared with transformers' run of its precision
(and with the fp64 reference), and transformers' fp32 run with its bf16 one.

What every tensor used of what compare allows it is its fraction: the relative difference over its
threshold (compare/thresholds.py), the norm and sum ratios' deviation over the scale check's tolerance
(compare/scale.py), the kind's median norm ratio's deviation over WHOLE_TOLERANCE, and each run's
difference to the reference over its rounding budget (compare/reference.py). The tolerances hold when
no tensor of the calibration texts uses more than half of its, and the held-out texts then pass too.
The figures behind FLOOR and SPREAD are printed as well: the largest deviation of the norm ratio
alone, and times sqrt(elements), per precision.

    python bench/calibrate.py [--out DIR] [--texts calibration|held-out|all] [--jobs N]

With --out the reports and the per-tensor records (records.jsonl) are kept, and a second call reuses
the comparisons already made. Each dump is removed once compared (a run of the 135M model writes 1.5 to
2 GB): the sweep needs some 10 GB of disk at a time.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from real_checkpoint import build  # noqa: E402
from texts import BATCH, CALIBRATION, HELD_OUT, batch_tokens  # noqa: E402

from megalign.compare.metrics import TensorMetrics  # noqa: E402
from megalign.compare.reference import BUDGET  # noqa: E402
from megalign.compare.scale import (WHOLE_TOLERANCE, check_scale, check_small, deviation, ratios,  # noqa: E402
                                    tolerance)
from megalign.compare.thresholds import DEFAULTS, sized  # noqa: E402

MEGALIGN = [sys.executable, "-m", "megalign"]
SEQ_LEN = "36"  # a multiple of 2*CP for CP=2; TP=3 divides it (SP), the model's 9 heads and 3 groups
LAYOUTS = {"tp3": ["--tp", "3"], "cp2": ["--cp", "2"], "tp3-sp": ["--tp", "3", "--sp"], "pp2": ["--pp", "2"],
           "packed-cp2": ["--cp", "2", "--packed"]}
DTYPES = {"fp32": [], "bf16": ["--dtype", "bf16"]}
RUNS = {"hf-fp32": ["--stack", "hf"], "hf-bf16": ["--stack", "hf", "--dtype", "bf16"],
        "hf-fp64": ["--stack", "hf", "--dtype", "fp64"],
        **{f"mcore-{layout}-{dtype}": args + extra for layout, args in LAYOUTS.items()
           for dtype, extra in DTYPES.items()}}
# (A, B): each compared as A vs B, with --reference hf-fp64.
PAIRS = [(f"hf-{dtype}", f"mcore-{layout}-{dtype}") for dtype in DTYPES for layout in LAYOUTS] + \
        [("hf-fp32", "hf-bf16")]


@dataclass
class Record:
    """One tensor of one comparison, and what it used of each tolerance compare gave it."""
    texts: str  # calibration or held-out
    batch: int
    pair: str
    kind: str
    name: str
    n: int
    shape: list[int]
    precision: str
    rel: float
    of_threshold: float  # rel / threshold
    norm_dev: float
    sum_dev: float
    of_scale: float  # the larger ratio deviation / the scale check's tolerance (0 where not checked)
    of_budget: float  # each side's rel to the reference / its budget, the larger (0 without one)
    norm_a: float  # for the pools of small tensors (scale.check_small)
    norm_b: float
    sum_a: float
    sum_b: float


def tokens_file(out: Path, batch: int) -> Path:
    path = out / f"tokens-{batch}.json"
    if not path.is_file():
        path.write_text(json.dumps(batch_tokens(build(), batch)))
    return path


def run(name: str, batch: int, mode: str, out: Path) -> Path:
    folder = out / f"{batch}" / name
    if not (folder / "dump.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)  # a run cut short
        args = MEGALIGN + [mode, "--hf", str(build()), "--tokens", str(tokens_file(out, batch)), "--out", str(folder),
                           *([] if "--packed" in RUNS[name] else ["--seq-len", SEQ_LEN]), *RUNS[name]]
        print(f"batch {batch}: run {name}", flush=True)
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return folder


def compare(a: Path, b: Path, reference: Path) -> Path:
    report = a.parent / f"{a.name}--{b.name}.jsonl"
    subprocess.run(MEGALIGN + ["compare", str(a), str(b), "--reference", str(reference), "--json", str(report)],
                   stdout=subprocess.DEVNULL)
    return report


def batch_reports(batch: int, mode: str, out: Path, jobs: int) -> list[tuple[tuple[str, str], Path]]:
    """Each pair's report of one batch. A dump of the 135M model is 1.5 to 2 GB: each megatron-core run is
    removed once compared, transformers' when the batch is done, so that a sweep needs some 10 GB of disk."""
    folder = out / f"{batch}"
    pending = [pair for pair in PAIRS if not (folder / f"{pair[0]}--{pair[1]}.jsonl").is_file()]
    if pending:
        hf = {name: run(name, batch, mode, out) for name in RUNS if name.startswith("hf-")}

        def one(pair: tuple[str, str]) -> None:
            b = hf.get(pair[1]) or run(pair[1], batch, mode, out)
            compare(hf[pair[0]], b, hf["hf-fp64"])
            if not pair[1].startswith("hf-"):
                shutil.rmtree(b)

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, pending))
        for dump in hf.values():
            shutil.rmtree(dump)
    return [(pair, folder / f"{pair[0]}--{pair[1]}.jsonl") for pair in PAIRS]


def _of(rel, table: dict, precision: str, kind: str, shape: list[int]) -> float:
    """What `rel` uses of its threshold or budget (0 where that is 0: inputs, compared exactly)."""
    allowed = sized(table, precision, kind, shape)
    return rel / allowed if rel is not None and allowed else 0.0


def records(report: Path, texts: str, batch: int, pair: tuple[str, str]) -> list[Record]:
    sides = [name.rsplit("-", 1)[1] for name in pair]  # each run's precision
    precision = "bf16" if "bf16" in sides else "fp32"
    found = []
    for line in report.read_text().splitlines()[:-1]:
        row = json.loads(line)
        m = row["metrics"]
        if not m or m.get("rel_diff") is None or row["kind"] == "input":
            continue
        n = math.prod(row["shape_a"])
        norm_ratio, sum_ratio = ratios(n, (m["norm_a"], m["norm_b"]), (m["sum_a"], m["sum_b"]))
        norm_dev, sum_dev = deviation(norm_ratio), deviation(sum_ratio) if sum_ratio is not None else 0.0
        # The threshold and the scale check as compare applies them without --reference (with it, the
        # reference judges the row: it has neither).
        of_scale = max(norm_dev, sum_dev) / tolerance(precision, n)
        of_threshold = _of(m["rel_diff"], DEFAULTS, precision, row["kind"], row["shape_a"])
        reference = row.get("reference") or {}
        of_budget = max(_of(reference.get(f"rel_{side}"), BUDGET, sides[i], row["kind"], row["shape_a"])
                        for i, side in enumerate("ab"))
        found.append(Record(texts=texts, batch=batch, pair=" vs ".join(pair), kind=row["kind"], name=row["name"], n=n,
                            shape=row["shape_a"],
                            precision=precision, rel=m["rel_diff"], of_threshold=of_threshold, norm_dev=norm_dev,
                            sum_dev=sum_dev, of_scale=of_scale, of_budget=of_budget,
                            **{k: m[k] for k in ("norm_a", "norm_b", "sum_a", "sum_b")}))
    return found


def medians(found: list[Record]) -> dict[tuple[str, str, str], float]:
    """(texts, pair, kind) -> the largest fraction of WHOLE_TOLERANCE a batch's median norm ratio used."""
    ratios_by = collections.defaultdict(list)
    for r in found:
        if r.kind in ("param_grad", "activation_grad"):
            ratios_by[(r.texts, r.batch, r.pair, r.kind, r.precision)].append(1 + r.norm_dev)
    worst: dict = collections.defaultdict(float)
    for (texts, _, pair, kind, precision), values in ratios_by.items():
        fraction = deviation(statistics.median(values)) / WHOLE_TOLERANCE[precision]
        worst[(texts, pair, kind)] = max(worst[(texts, pair, kind)], fraction)
    return worst


def pools(found: list[Record]) -> dict[tuple[str, str, str], float]:
    """(texts, pair, kind) -> the largest fraction of its tolerance a pool of small tensors used
    (scale.check_small: the tensors whose scale check alone verifies nothing, pooled per batch)."""
    judged = collections.defaultdict(list)
    for i, r in enumerate(found):
        metrics = TensorMetrics(rel_diff=r.rel, nan_a=0, nan_b=0, inf_a=0, inf_b=0, max_abs_diff=0.0,
                                max_abs_index=None, mean_abs_diff=0.0, cosine=1.0, norm_a=r.norm_a, norm_b=r.norm_b,
                                sum_a=r.sum_a, sum_b=r.sum_b)
        scale = check_scale(r.precision, r.n, metrics, sized(DEFAULTS, r.precision, r.kind, r.shape))
        judged[(r.texts, r.batch, r.pair)].append((i, r.kind, r.name, scale, r.norm_a, r.norm_b))
    worst: dict = collections.defaultdict(float)
    for (texts, _, pair), rows in judged.items():
        for pool, _ in check_small(rows):
            worst[(texts, pair, pool.kind)] = max(worst[(texts, pair, pool.kind)],
                                                  deviation(pool.norm_ratio) / pool.tolerance)
    return worst


def table(found: list[Record]) -> None:
    worst_median, worst_pool = medians(found), pools(found)
    groups = collections.defaultdict(list)
    for r in found:
        groups[(r.texts, r.pair, r.kind)].append(r)
    print(f"\n{'texts':10s} {'A vs B':32s} {'kind':15s} {'tensors':>7s} {'of thr':>7s} {'of scale':>8s} "
          f"{'of median':>9s} {'of pool':>7s} {'of ref':>7s}  the tensor of the largest fraction of scale")
    for (texts, pair, kind), rows in sorted(groups.items()):
        top = max(rows, key=lambda r: r.of_scale)
        print(f"{texts:10s} {pair:32s} {kind:15s} {len(rows):7d} {max(r.of_threshold for r in rows):7.2f} "
              f"{top.of_scale:8.2f} {worst_median.get((texts, pair, kind), 0.0):9.2f} "
              f"{worst_pool.get((texts, pair, kind), 0.0):7.2f} "
              f"{max(r.of_budget for r in rows):7.2f}  {top.name}")
    for precision in DTYPES:
        grads = [r for r in found if r.precision == precision and r.kind in ("param_grad", "activation_grad")]
        if grads:
            print(f"\n{precision}: the norm ratio deviates up to {max(r.norm_dev for r in grads):.3g} alone, "
                  f"{max(r.norm_dev * math.sqrt(r.n) for r in grads):.3g} times sqrt(n); "
                  f"{sum(r.of_scale > 1 or r.of_threshold > 1 for r in grads)} of {len(grads)} gradients fail")
    for texts in ("calibration", "held-out"):
        rows = [r for r in found if r.texts == texts]
        if rows:
            fraction = max([max(r.of_threshold, r.of_scale, r.of_budget) for r in rows] +
                           [v for k, v in {**worst_median, **worst_pool}.items() if k[0] == texts])
            failed = sum(r.of_scale > 1 or r.of_threshold > 1 for r in rows)
            print(f"{texts}: {len(rows)} tensors, the largest fraction of a tolerance {fraction:.2f}, "
                  f"{failed} not passing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="keep the dumps here (default: a temporary folder)")
    parser.add_argument("--mode", default="backward", choices=("forward", "backward"))
    parser.add_argument("--texts", default="all", choices=("calibration", "held-out", "all"))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    args = parser.parse_args()
    sets = {"calibration": CALIBRATION, "held-out": HELD_OUT}
    batches = {b: texts for texts, indices in sets.items() if args.texts in (texts, "all")
               for b in range(indices.start // BATCH, indices.stop // BATCH)}
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        found = []
        for batch, texts in batches.items():
            for pair, report in batch_reports(batch, args.mode, out, args.jobs):
                found += records(report, texts, batch, pair)
        (out / "records.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in found))
        table(found)


if __name__ == "__main__":
    main()
