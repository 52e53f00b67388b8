"""The `megalign` command."""

from __future__ import annotations

import typer

from megalign.cli import backward, check, compare, forward

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
app.command("compare")(compare.compare)
# Options check does not know go to every run it starts.
app.command("check", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(check.check)


def main() -> None:
    app()
