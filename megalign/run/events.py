"""Progress and failure events from workers to the launcher: one `@@megalign {json}` line each.

Workers share the launcher's stdout, so a prefixed JSON line per event is enough: no socket, no
file polling. Under `--launcher none` there is no launcher to read them: the rank's own megalign
process sets a sink (launch.run_here) that renders them instead.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Callable, Optional

PREFIX = "@@megalign "


def print_line(event: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


_sink: Callable[[dict], None] = print_line


def set_sink(sink: Callable[[dict], None]) -> None:
    global _sink
    _sink = sink


def emit(event: str, rank: int, **fields) -> None:
    _sink({"event": event, "rank": rank, **fields})


def emit_failure(rank: int, error: BaseException) -> None:
    """UserError and RunFailed are megalign's own verdicts: their message is the story, no traceback."""
    from megalign.errors import RunFailed, UserError

    own = isinstance(error, (UserError, RunFailed))
    emit("failed", rank, error=str(error) if own else f"{type(error).__name__}: {error}",
         user_error=isinstance(error, UserError), traceback="" if own else "".join(traceback.format_exception(error)))


def parse(line: str) -> Optional[dict]:
    """The event on a line of worker output, or None for ordinary output."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    try:
        return json.loads(line[start + len(PREFIX):])
    except json.JSONDecodeError:
        return None
