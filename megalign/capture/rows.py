"""The batch's rows as a Dumper's watched model saw them, step by step: what dump.json's `rows` (or
`step_rows`) records, so that compare lines up runs padded or packed differently token by token.

Each rank logs its rows in every dumped step from the watched model's calls (an attention mask, or
packed_seq_params). What cannot be recorded (a 4D or left-padded mask, two forward calls of one step
with other rows, DP ranks padded to different lengths) is never raised inside a hook, where one rank
would stop mid-step and leave the others in a collective: the rows are dropped with a warning and
dump.json says why (`rows_unknown`); compare then sets apart the token tensors whose shapes differ.
Only a packed dump whose rows were split per document over CP ranks cannot land without them (its
tensors cannot be put back together): close() refuses it, on every rank at once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

from megalign.dump.layout import BatchRow
from megalign.errors import UserError


@dataclass
class RowLog:
    """One rank's rows in each dumped step (None: a call outside any step block), or why they cannot
    be recorded."""

    by_step: dict[Optional[int], tuple[BatchRow, ...]] = field(default_factory=dict)
    unknown: Optional[str] = None

    def saw(self, step: Optional[int], rows: tuple[BatchRow, ...]) -> None:
        if self.by_step.setdefault(step, rows) != rows:
            self.lose(f"two forward calls of step {step} saw different rows (gradient accumulation over "
                      f"differently padded micro-batches?)")

    def lose(self, reason: str) -> None:
        if self.unknown is None:
            self.unknown = reason
            warn_unknown(reason)


def warn_unknown(reason: str) -> None:
    warnings.warn(f"megalign.Dumper: the batch's rows are not recorded ({reason}); compare sets apart the token "
                  f"tensors whose shapes differ from the other run's", stacklevel=3)


def rows_meta(logs: dict[int, RowLog], dp: int, packed: bool, cp_split: str, cp: int) -> dict:
    """dump.json's fields for every DP rank's rows (`logs` by dp_rank): `rows` where every dumped
    step saw the same, `step_rows` where they differ, `rows_unknown` where they cannot be recorded."""
    if not any(log.by_step or log.unknown for log in logs.values()):
        return {}
    whole = {"cp_split": cp_split, "packed": True} if packed else {}
    unknown = _unknown(logs, dp)
    if unknown is not None:
        if packed and cp > 1 and cp_split == "document":
            raise UserError(f"packed rows split per document over CP ranks cannot be put back together without "
                            f"them, and they are not known: {unknown}")
        if not any(log.unknown for log in logs.values()):  # a rank that lost its rows warned already
            warn_unknown(unknown)
        return {"rows_unknown": unknown}
    steps = {step: [row for rank in range(dp) for row in logs[rank].by_step[step]] for step in logs[0].by_step}
    first = next(iter(steps.values()))
    if all(rows == first for rows in steps.values()):
        return {**_rows_fields(first), **whole}
    if packed and cp > 1 and cp_split == "document":
        raise UserError("packed rows split per document over CP ranks differ between the dumped steps, and a "
                        "dump puts them back together by one set of rows: dump one step (steps=[n])")
    return {"step_rows": [{"step": step, **_rows_fields(rows)} for step, rows in steps.items()], **whole}


def _unknown(logs: dict[int, RowLog], dp: int) -> Optional[str]:
    """Why the ranks' rows cannot make one record: the first rank's reason, or a mismatch between them."""
    if any(rank not in logs for rank in range(dp)):
        return "some DP ranks' rows were not gathered"
    reason = next((f"DP rank {rank}: {logs[rank].unknown}" for rank in range(dp) if logs[rank].unknown), None)
    if reason:
        return reason
    steps = set(logs[0].by_step)
    for rank in range(dp):
        if set(logs[rank].by_step) != steps:
            return f"DP rank {rank} saw rows in steps {sorted(logs[rank].by_step, key=str)}, DP rank 0 in " \
                   f"{sorted(steps, key=str)}"
    for step in steps:
        lengths = sorted({row.bounds[-1] for rank in range(dp) for row in logs[rank].by_step[step]})
        if len(lengths) > 1:
            return f"in step {step} the DP ranks' rows are padded to different lengths {lengths}"
    return None


def _rows_fields(rows: list[BatchRow]) -> dict:
    return {"rows": [row.to_dict() for row in rows], "num_sequences": sum(len(row.lengths) for row in rows)}
