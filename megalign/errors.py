"""Errors a user can fix: the CLI prints them as one line and exits non-zero, never a traceback; and the
kinds of value a user's file (or a dump's JSON) must hold to be read at all."""

import errno
import os
import re
import stat
from pathlib import Path
from typing import Optional

# A config or a tokens file is kilobytes: a bigger one is the wrong file, read only to exhaust memory.
MAX_USER_FILE = 64 << 20


class UserError(Exception):
    """Bad input (config, tokens, layout, paths). Exit code 2."""

    exit_code = 2


class RunFailed(Exception):
    """A worker failed or the run timed out. Exit code 1; `details` holds the failing traceback."""

    exit_code = 1

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def is_int(value: object) -> bool:
    """An integer as a file means one: Python's bool is an int (True == 1), a file's `true` is no count."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float, not a bool (is_int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def disk_full(error: BaseException) -> Optional[UserError]:
    """`error` as the UserError it is where it stems from a full disk or quota (ENOSPC, EDQUOT), anywhere in its
    chain: a writing thread's OSError reaches the run under the RuntimeError that reports it. Else None."""
    cause = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return UserError(str(error))
        cause = cause.__cause__ or cause.__context__
    return None


def compile_pattern(option: str, text: str) -> re.Pattern:
    """A user's regular expression, or a UserError naming the option it came from."""
    try:
        return re.compile(text)
    except re.error as e:
        raise UserError(f"{option} {text!r} is not a valid regular expression: {e}") from None


def read_user_text(path: Path, what: str, limit: int = MAX_USER_FILE) -> str:
    """The text of a file the user named (`what`: "config", "tokens file"), or a UserError saying why not.
    Only a regular file of at most `limit` bytes is read (never /dev/zero, a FIFO or a disk)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO must not wait for a writer
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise UserError(f"{what} {path} is a folder, not a file" if stat.S_ISDIR(mode) else
                            f"{what} {path} is not a regular file")
        with os.fdopen(fd, "rb") as file:
            # A buffered read of a size reads until it has that many bytes or the end (os.read may stop
            # short); bounded even when the file grows meanwhile.
            data = file.read(limit + 1)
        if len(data) > limit:
            raise UserError(f"{what} {path} is larger than {limit >> 20} MiB; is it the right file?")
        return data.decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path}: unreadable ({type(e).__name__}: {e})") from None
