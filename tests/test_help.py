"""`--help` reads as a manual: flags without placeholders, every option with its default and what it does."""

from __future__ import annotations

import pytest
import typer
from conftest import invoke

from megalign.cli.app import app
from megalign.rollouts.formats import FORMATS

COMMANDS = ("forward", "backward", "compare", "check")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_placeholders(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    for placeholder in ("<bool>", "<list[", "{", "}"):
        assert placeholder not in result.output, (placeholder, result.output)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_says_its_default_and_what_it_does(command):
    click_command = typer.main.get_command(app).commands[command]
    options = [param for param in click_command.params if param.param_type_name == "option"]
    assert len(options) > 5  # the loop below checks something
    for param in click_command.params:
        # typer ships its own copy of click: its options are not click.Option instances
        if param.param_type_name != "option" or param.hidden or param.name == "help":
            continue
        assert param.help and len(param.help) > 10, param.name
        shown = param.show_default is not False and param.default is not None and param.default is not False \
            and param.default not in ([], ())  # 0 is a default shown as such (0 == False, hence `is not`)
        assert shown or "Default" in param.help, f"--{param.name} does not say its default"


def test_overwrite_says_what_it_deletes():
    help_text = " ".join(invoke("forward", "--help").output.split())  # as one line: help text wraps
    assert "megalign dump" in help_text and "never deleted" in help_text


def test_rollout_names_every_format_megalign_reads():
    """--rollout's help lists the formats from their one registry (it once left slime out): every name
    rollouts/formats.py gives is in it, as `megalign forward` declares it."""
    params = typer.main.get_command(app).commands["forward"].params
    rollout = next(param for param in params if param.name == "rollout")
    assert [f.name for f in FORMATS if f.name not in rollout.help] == []
