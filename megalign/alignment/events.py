"""Progress and failure events from workers to the launcher: one `@@megalign {json}` line each.

Workers share the launcher's stdout, so a prefixed JSON line per event is enough: no socket, no
file polling, and works the same under `--launcher none` (where the lines are simply printed).
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Optional

PREFIX = "@@megalign "


def emit(event: str, rank: int, **fields) -> None:
    sys.stdout.write(PREFIX + json.dumps({"event": event, "rank": rank, **fields}) + "\n")
    sys.stdout.flush()


def emit_failure(rank: int, error: BaseException) -> None:
    """UserError and RunFailed are megalign's own verdicts: their message is the story, no traceback."""
    from megalign.alignment.errors import RunFailed, UserError

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
