"""`--json FILE`: the report as JSON lines, one record per tensor and a final summary record.

    {"record": "tensor", "order": 0, "kind": "activation", "name": "...", "layer": 0,
     "status": "pass", "threshold": 1e-08, "shape_a": [...], "shape_b": [...], "dtype_a": "float32",
     "dtype_b": "float32", "dtype_mismatch": false, "first_divergence": false,
     "metrics": {"mode": "values", "rel_diff": ..., "max_abs_diff": ..., "max_abs_index": [...],
                 "mean_abs_diff": ..., "cosine": ..., "norm_a": ..., "norm_b": ...,
                 "sum_a": ..., "sum_b": ..., "nan_a": 0, "nan_b": 0, "inf_a": 0, "inf_b": 0},
     "logprobs": null, "replica_diff_a": null, "replica_diff_b": null, "reference": null,
     "scale": {"norm_ratio": 1.0, "sum_ratio": null, "tolerance": 1e-05, "off": false}, "notes": []}
    {"record": "summary", "a": {...}, "b": {...}, "compared": ..., "passed": ..., ..., "ok": true}

Non-finite floats are written as null, so that every line is strict JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional

from megalign.compare.metrics import StatsMetrics
from megalign.compare.rollout_findings import RolloutFindings
from megalign.compare.verdict import Report, Row


def row_record(row: Row, first_divergence: bool) -> dict:
    record = {"record": "tensor", **dataclasses.asdict(row), "first_divergence": first_divergence}
    record["order"] = record.pop("index")  # position in execution order
    if row.metrics is not None:
        record["metrics"] = {"mode": "stats" if isinstance(row.metrics, StatsMetrics) else "values",
                             **dataclasses.asdict(row.metrics)}
    return record


def summary_record(report: Report, rollout: Optional[RolloutFindings] = None) -> dict:
    record = {"record": "summary",
              **{side: {"path": str(s.path), "format": s.format, "description": s.description}
                 for side, s in (("a", report.a), ("b", report.b))},
              **dataclasses.asdict(report.summary), "ok": report.summary.ok}
    if rollout is not None:
        findings = dataclasses.asdict(rollout)
        del findings["gaps"]  # one per sequence: the worst are what a reader wants, --export-worst the rest
        record["rollout"] = findings
    return record


def write_jsonl(report: Report, path: Path, rollout: Optional[RolloutFindings] = None) -> None:
    with open(path, "w") as out:
        for row in report.rows:
            out.write(json.dumps(_strict(row_record(row, row.index == report.first_divergence))) + "\n")
        out.write(json.dumps(_strict(summary_record(report, rollout))) + "\n")


def is_report(path: Path) -> bool:
    """Whether `path` holds what write_jsonl writes: tensor records, then the summary record, one a line."""
    try:
        with open(path, encoding="utf-8") as file:
            kinds = [_record_kind(line) for line in file]  # stops at the first line that is not JSON
    except (OSError, ValueError):
        return False
    return kinds[-1:] == ["summary"] and set(kinds[:-1]) <= {"tensor"}


def _record_kind(line: str) -> Optional[str]:
    record = json.loads(line)
    return record.get("record") if isinstance(record, dict) else None


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value
