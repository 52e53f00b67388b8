"""Errors a user can fix: the CLI prints them as one line and exits non-zero, never a traceback."""


class UserError(Exception):
    """Bad input (config, tokens, layout, paths). Exit code 2."""

    exit_code = 2


class RunFailed(Exception):
    """A worker failed or the run timed out. Exit code 1; `details` holds the failing traceback."""

    exit_code = 1

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details
