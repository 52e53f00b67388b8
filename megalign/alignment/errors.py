"""Errors a user can fix: the CLI prints them as one line and exits non-zero, never a traceback."""

import re
from pathlib import Path


class UserError(Exception):
    """Bad input (config, tokens, layout, paths). Exit code 2."""

    exit_code = 2


class RunFailed(Exception):
    """A worker failed or the run timed out. Exit code 1; `details` holds the failing traceback."""

    exit_code = 1

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def compile_pattern(option: str, text: str) -> re.Pattern:
    """A user's regular expression, or a UserError naming the option it came from."""
    try:
        return re.compile(text)
    except re.error as e:
        raise UserError(f"{option} {text!r} is not a valid regular expression: {e}") from None


def read_user_text(path: Path, what: str) -> str:
    """The text of a file the user named (`what`: "config", "tokens file"), or a UserError saying why not."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a folder, not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path}: unreadable ({type(e).__name__}: {e})") from None
