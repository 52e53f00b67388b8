"""The run options are declared once (megalign/options.py): the commands, the RunSpec and the dump cache follow."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import typer
from conftest import run_key

from megalign.cli.app import app
from megalign.options import FLAG, RunConfig, option_fields
from megalign.spec import RunSpec


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_the_commands_take_exactly_the_tree_s_options(mode):
    command = typer.main.get_command(app).commands[mode]
    params = {p.name: p for p in command.params if p.name != "help"}
    assert list(params) == [f.name for f, _ in option_fields()]
    for f, _ in option_fields():
        flag = f.metadata[FLAG]
        assert (params[f.name].opts + params[f.name].secondary_opts)[0] == flag.spelling[0]
        assert params[f.name].default == f.default and params[f.name].help == flag.help


def test_runspec_fields_named_as_options_have_their_types_and_defaults():
    options = {f.name: (f, hint) for f, hint in option_fields()}
    hints = typing.get_type_hints(RunSpec)
    # Resolved from their options: a str for a Path, the token ids, the padded length, cpu or cuda for auto.
    resolved = ("out", "hf", "load", "save", "tokens", "seq_len", "device")
    shared = [f for f in dataclasses.fields(RunSpec) if f.name in options and f.name not in resolved]
    assert len(shared) == 14, [f.name for f in shared]
    for f in shared:
        option, hint = options[f.name]
        assert (hints[f.name], f.default) == (hint, option.default), f.name


def test_the_default_out_names_the_layout():
    assert run_key("backward").dump_folder() == Path("dumps/backward-tp1-pp1-cp1")
    assert run_key("forward", "--tp", "2", "--sp", "--dp", "2", "--ep", "2", "--packed").dump_folder() == \
        Path("dumps/forward-tp2-pp1-cp1-dp2-sp-ep2-thd")
    assert run_key("backward", "--stack", "hf").dump_folder() == Path("dumps/backward-hf")
    assert run_key("backward", "--out", "mine").out is None  # the cache's key leaves --out out


def test_equivalent_command_lines_share_one_session_dump():
    assert run_key("backward") == run_key("backward", "--cp", "1") == run_key("backward", "--out", "elsewhere")
    assert run_key("backward", "--tokens", Path("t.json")) == run_key("backward", "--tokens", "t.json")
    assert run_key("backward") != run_key("backward", "--cp", "2")
    assert run_key("backward") != run_key("forward")
    assert isinstance(run_key("backward"), RunConfig)
