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
import os
from pathlib import Path
from typing import Any, Optional

from megalign.compare.rollout_findings import RolloutFindings
from megalign.compare.records import Report


# How much of each end of a file is_report reads. A tensor record is under 2 KiB; the summary lists a name per
# tensor at most (nonfinite_in_both): 16 MiB holds it for some 100,000 tensors, and a larger one is not replaced.
END_BYTES = 16 << 20


def records(report: Report, rollout: Optional[RolloutFindings] = None) -> list[dict]:
    """The report's records (Report.json), the summary's with a rollout's findings where one was compared."""
    found = report.json()
    if rollout is not None:
        findings = dataclasses.asdict(rollout)
        del findings["gaps"]  # one per sequence: the worst are what a reader wants, --export-worst the rest
        found[-1]["rollout"] = findings
    return found


def write_jsonl(report: Report, path: Path, rollout: Optional[RolloutFindings] = None) -> None:
    with open(path, "w") as out:
        for record in records(report, rollout):
            out.write(json.dumps(_strict(record)) + "\n")


def is_report(path: Path) -> bool:
    """Whether `path` holds what write_jsonl writes: tensor records, then the summary record, one a line.
    Only its two ends are read, END_BYTES each, so that a user's file of any size (a disk image, a core
    dump without a newline) costs no more: a tensor record first and the summary last, or the summary alone."""
    try:
        with open(path, "rb") as file:
            first = file.readline(END_BYTES)
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - END_BYTES))
            last = _last_line(file.read(END_BYTES), whole=size <= END_BYTES)
        kinds = _record_kind(first), _record_kind(last)
    except (OSError, ValueError):  # UnicodeDecodeError and JSON's errors are ValueErrors
        return False
    if kinds == ("summary", "summary"):
        return len(first) == size  # the one line of a report of no tensor
    return kinds == ("tensor", "summary")


def _last_line(tail: bytes, whole: bool) -> bytes:
    """The last line of a file that ends in `tail` (`whole`: the whole file); ValueError where it is longer."""
    _, newline, last = tail.removesuffix(b"\n").rpartition(b"\n")
    if not newline and not whole:
        raise ValueError(f"a last line longer than {END_BYTES} bytes")
    return last


def _record_kind(line: bytes) -> Optional[str]:
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
