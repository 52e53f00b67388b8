"""The `megalign` command."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperCommand

from megalign.cli import backward, check, compare, forward
from megalign.cli.render import err_console


class PlainUsage(TyperCommand):
    """The usage line names required arguments as their help does (`A B`), not typer's `{A} {B}`."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]


app = typer.Typer(
    name="megalign",
    help="Find where two runs of the same LLM stop agreeing numerically: dump a Megatron-core (or HF) "
         "forward/backward under any TP/PP/CP layout, then compare two dumps tensor by tensor.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: rich mode prints <bool> after flags and ignores metavars.
    rich_markup_mode=None,
)
app.command("forward")(forward.forward)
app.command("backward")(backward.backward)
app.command("compare", cls=PlainUsage)(compare.compare)
# Options check does not know go to every run it starts.
app.command("check", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(check.check)


def main() -> None:
    try:
        app()
    except OSError as error:
        if error.filename is not None or isinstance(error, BrokenPipeError):
            raise  # a file's error names its file, and is a UserError where the user can mend it
        # Standard output that cannot take the report (`> /dev/full`, a full disk): one line, exit 2.
        err_console.print(f"[bold red]error:[/] cannot write to standard output: {error.strerror}", highlight=False)
        sys.exit(2)
