"""Progress and failure events from every stack's workers to the launcher (run/launch.py): one
`@@megalign {json}` line each.

Workers share the launcher's stdout, so a prefixed JSON line per event is enough: no socket, no
file polling. A worker run in megalign's own process (`--launcher none`, `--stack hf`) has no
launcher to read them: the process sets a sink (launch.py) that takes them instead.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from typing import Callable, Iterator, Optional

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


@contextlib.contextmanager
def failures_reported(rank: int) -> Iterator[None]:
    """A worker's whole run: a failure is reported, then raised again so that torchrun sees it too (a full
    disk as the UserError it is, which a run in megalign's own process, --stack hf, prints as one line)."""
    from megalign.errors import disk_full

    try:
        yield
    except BaseException as error:
        full = disk_full(error)
        emit_failure(rank, full or error)
        if full is None:
            raise
        raise full from error


def parse(line: str) -> Optional[dict]:
    """The event on a line of worker output, or None for ordinary output."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    try:
        return json.loads(line[start + len(PREFIX):])
    except json.JSONDecodeError:
        return None
