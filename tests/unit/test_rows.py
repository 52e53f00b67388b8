"""What dump.json records of a Dumper's rows (capture/rows.py), from every DP rank's log of its rows
step by step: one `rows` where the steps agree, `step_rows` where they differ (dynamic padding), and
`rows_unknown` with a warning where they cannot be recorded, never an error inside a hook; only a
packed dump split per document over CP ranks, which cannot be put back together without its rows,
is refused."""

from __future__ import annotations

import pytest

from megalign.dump.layout import BatchRow
from megalign.capture.rows import RowLog, rows_meta
from megalign.errors import UserError


def padded(*lengths: int, to: int = 8) -> tuple[BatchRow, ...]:
    return tuple(BatchRow(bounds=(0, to), lengths=(n,)) for n in lengths)


def logged(*steps: tuple[BatchRow, ...]) -> RowLog:
    log = RowLog()
    for step, rows in enumerate(steps):
        log.saw(step, rows)
        log.saw(step, rows)  # a second forward call of the step with the same rows: nothing lost
    return log


def test_rows_the_same_in_every_step_are_recorded_once_in_dp_rank_order():
    logs = {1: logged(padded(3), padded(3)), 0: logged(padded(8), padded(8))}
    assert rows_meta(logs, 2, packed=False, cp_split="document", cp=1) == {
        "rows": [{"bounds": [0, 8], "lengths": [8]}, {"bounds": [0, 8], "lengths": [3]}], "num_sequences": 2}


def test_rows_that_change_from_step_to_step_are_recorded_by_step():
    meta = rows_meta({0: logged(padded(8, 5), padded(4, 2))}, 1, packed=False, cp_split="document", cp=1)
    assert [(step["step"], [row["lengths"] for row in step["rows"]]) for step in meta["step_rows"]] == [
        (0, [[8], [5]]), (1, [[4], [2]])]
    assert "rows" not in meta


def test_rows_that_cannot_be_recorded_are_dropped_with_a_warning_and_the_reason():
    with pytest.warns(UserWarning, match="padded to different lengths"):
        meta = rows_meta({0: logged(padded(8, to=16)), 1: logged(padded(3, to=12))}, 2, packed=False,
                         cp_split="document", cp=1)
    assert meta == {"rows_unknown": "in step 0 the DP ranks' rows are padded to different lengths [12, 16]"}
    log = RowLog()
    log.saw(0, padded(8))
    with pytest.warns(UserWarning, match="two forward calls of step 0 saw different rows"):
        log.saw(0, padded(5))  # gradient accumulation over differently padded micro-batches
    assert rows_meta({0: log}, 1, packed=False, cp_split="document", cp=1) == {
        "rows_unknown": "DP rank 0: two forward calls of step 0 saw different rows (gradient accumulation over "
                        "differently padded micro-batches?)"}  # warned once, when it was lost


def test_a_packed_dump_split_per_document_over_cp_ranks_needs_one_set_of_rows():
    one, other = (BatchRow(bounds=(0, 8, 16), lengths=(8, 6)),), (BatchRow(bounds=(0, 12, 16), lengths=(12, 4)),)
    with pytest.raises(UserError, match="differ between the dumped steps"):
        rows_meta({0: logged(one, other)}, 1, packed=True, cp_split="document", cp=2)
    unknown = RowLog(unknown="input_ids [1, 8] on each of 2 CP ranks is not one packed row")
    with pytest.raises(UserError, match="cannot be put back together"):
        rows_meta({0: unknown}, 1, packed=True, cp_split="document", cp=2)
    # Split as one sequence (or at CP=1) a packed dump is put back together without them.
    meta = rows_meta({0: logged(one, other)}, 1, packed=True, cp_split="row", cp=2)
    assert len(meta["step_rows"]) == 2 and meta["packed"] and meta["cp_split"] == "row"


def test_a_dumper_that_saw_no_rows_records_none():
    assert rows_meta({0: RowLog(), 1: RowLog()}, 2, packed=False, cp_split="document", cp=1) == {}
