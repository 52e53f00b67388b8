"""The docs show only what works: every `megalign ...` command in a fenced block of README.md or docs/*.md
parses against the real CLI and is run, with the same options, by a test; every relative link resolves.

No model runs here: commands are parsed with click's own `make_context` (a stale or misspelt option fails),
and "a test runs it" is read from the test sources: some function in tests/ (a test, a fixture, a helper)
names the subcommand and every option the doc command gives, by any of its spellings (`-c` or `--config`).
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.exceptions import TyperException

from megalign.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI = typer.main.get_command(app)
FENCE = re.compile(r"^```([\w-]*)\s*$")
SHELL_LANGUAGES = {"", "sh", "bash", "shell", "console"}


@dataclass(frozen=True)
class DocCommand:
    """One `megalign ...` command of a fenced block: where it is and its arguments after `megalign`."""

    where: str
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: megalign {shlex.join(self.args)}"


def fenced_shell_lines(path: Path):
    """(line number, line) of every line inside a fenced block without a language or of a shell's,
    with `\\`-continued lines joined onto their first."""
    language = None
    pending, start = "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            language = fence.group(1) if language is None else None
            continue
        if language not in SHELL_LANGUAGES:
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def doc_commands() -> list[DocCommand]:
    """Every `megalign ...` line of a fenced shell block in the docs, its `# comment` dropped."""
    commands = []
    for path in DOCS:
        for number, line in fenced_shell_lines(path):
            if not line.startswith("megalign "):
                continue
            words = shlex.split(line, comments=True)
            commands.append(DocCommand(f"{path.relative_to(ROOT)}:{number}", tuple(words[1:])))
    return commands


COMMANDS = doc_commands()


def parse(args: list[str]) -> typer.Context:
    """`megalign ARGS` parsed as the CLI parses it, without running it."""
    command = CLI.commands[args[0]]
    return command.make_context(f"megalign {args[0]}", list(args[1:]))


def run_argvs(command: DocCommand) -> list[list[str]]:
    """The command, and for `check` each run it starts: `MODE SHARED... OWN...` as check builds them."""
    context = parse(list(command.args))
    if command.args[0] != "check":
        return [list(command.args)]
    mode, shared = context.params["mode"], list(context.args)
    return [[mode, *shared, *shlex.split(context.params[side])] for side in ("baseline", "target")]


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 10, COMMANDS
    assert {c.args[0] for c in COMMANDS} >= {"forward", "backward", "compare", "check"}


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_doc_command_parses(command):
    argv = list(command.args)
    try:
        for argv in run_argvs(command):
            parse(argv)
    except TyperException as e:  # typer's own click: a usage error or a bad value
        pytest.fail(f"{command}\n  megalign {shlex.join(argv)}: {e.format_message()}")


def option_names(args: list[str]) -> set[str]:
    """The options `megalign ARGS` sets, by their parameter names (so `-c` and `--config` are one)."""
    spelled = {flag: param.name for param in CLI.commands[args[0]].params if param.param_type_name == "option"
               for flag in (*param.opts, *param.secondary_opts)}
    return {spelled[word] for word in args[1:] if word in spelled}


def doc_options(command: DocCommand) -> set[tuple[str, str]]:
    """(command, option) pairs a test must give: the command's own, and for check each run's too."""
    pairs = {(command.args[0], name) for name in option_names(list(command.args))}
    if command.args[0] == "check":
        pairs |= {(argv[0], name) for argv in run_argvs(command) for name in option_names(argv)}
    return pairs


def strings(node: ast.AST) -> set[str]:
    """The words of a node's string constants: an f-string's literal parts, and a string of several
    options ("--cp 2 --loss-norm local") split."""
    return {word for const in ast.walk(node) if isinstance(const, ast.Constant) and isinstance(const.value, str)
            for word in const.value.split()}


@dataclass
class SourceModule:
    path: Path
    constants: dict[str, ast.AST]  # module-level assignments, e.g. CP2_LOCAL = ("backward", "--cp", "2", ...)
    functions: dict[str, ast.AST]  # module-level functions: tests, fixtures, helpers


def source_modules() -> list[SourceModule]:
    """Every module of tests/ but this one, with its module-level constants and functions."""
    modules = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue  # this file names options only to read them
        tree = ast.parse(path.read_text())
        constants = {target.id: node.value for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                     for target in getattr(node, "targets", [getattr(node, "target", None)])
                     if isinstance(target, ast.Name) and node.value is not None}
        functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        modules.append(SourceModule(path, constants, functions))
    return modules


def function_words(modules: list[SourceModule], module: SourceModule, node: ast.AST, depth: int = 2) -> set[str]:
    """A function's words, with those of the module constants it names and, `depth` calls deep, of the
    helpers it calls and the fixtures it takes (found in its own module first, then in any other)."""
    words = strings(node)
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names |= {arg.arg for arg in node.args.args}
    for name in names:
        for other in sorted(modules, key=lambda m: m is not module):
            if name in other.constants:
                words |= strings(other.constants[name])
                break
            if name in other.functions and other.functions[name] is not node:
                if depth:
                    words |= function_words(modules, other, other.functions[name], depth - 1)
                break
    return words


def functions_in_tests():
    """(test::function, words) for every function in tests/, nested ones too, decorators included."""
    modules = source_modules()
    for module in modules:
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{module.path.relative_to(ROOT)}::{node.name}", function_words(modules, module, node)


TEST_FUNCTIONS = list(functions_in_tests())


def spellings(subcommand: str, option: str) -> set[str]:
    """How an option may be written: `--config` and `-c`."""
    param = next(p for p in CLI.commands[subcommand].params if p.name == option)
    return {*param.opts, *param.secondary_opts}


def gives(words: set[str], subcommand: str, option: str) -> bool:
    """Whether a function with these words gives `subcommand`'s `option` (by any of its spellings)."""
    return bool(words & spellings(subcommand, option))


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_doc_command_is_one_a_test_runs(command):
    needed = doc_options(command)
    candidates = [(name, words) for name, words in TEST_FUNCTIONS if command.args[0] in words]
    for name, words in candidates:
        if all(gives(words, subcommand, option) for subcommand, option in needed):
            return
    closest = max(candidates, key=lambda f: sum(gives(f[1], s, o) for s, o in needed))
    missing = sorted(f"{s} {'/'.join(sorted(spellings(s, o)))}" for s, o in needed if not gives(closest[1], s, o))
    pytest.fail(f"no test runs {command}\n  closest: {closest[0]}, which lacks {missing}")


def prose_lines(path: Path):
    """(line number, line) of every line outside the fenced blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def links():
    """(file, line number, target) of every relative Markdown link and image in the docs."""
    for path in DOCS:
        for number, line in prose_lines(path):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if not re.match(r"[a-z]+:", target):
                    yield path, number, target


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to dashes."""
    slugs = set()
    for _, line in prose_lines(path):
        heading = re.match(r"#+ (.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            slugs.add(text.replace(" ", "-"))
    return slugs


@pytest.mark.parametrize("path,number,target", list(links()), ids=lambda v: str(v).removeprefix(f"{ROOT}/"))
def test_relative_link_resolves(path, number, target):
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    assert resolved.exists(), f"{path.relative_to(ROOT)}:{number}: {target} names no file"
    if anchor:
        assert anchor in anchors(resolved), f"{path.relative_to(ROOT)}:{number}: {target}: no such heading"


# docs/development.md's map of the package: its first `text` block, one entry a line ("name.py" or
# "folder/", then two spaces and what it holds), each folder's entries indented two spaces under it; a
# line indented to the descriptions' column continues the entry above.
DEVELOPMENT = ROOT / "docs" / "development.md"
MAP_ENTRY = re.compile(r"^( *)([\w.]+(?:/|\.py))(?: {2,}\S.*)?$")
DESCRIPTIONS = 28  # the column the descriptions start at


def package_modules() -> set[str]:
    """Every module and package folder of megalign, as the map names them (a package's __init__.py is
    its folder's entry)."""
    package = ROOT / "megalign"
    return {str(path.relative_to(ROOT)) + "/" for path in [package, *package.rglob("*")]
            if (path / "__init__.py").is_file()} | \
        {str(path.relative_to(ROOT)) for path in package.rglob("*.py") if path.name != "__init__.py"}


def mapped_modules(text: str) -> tuple[set[str], list[str]]:
    """The paths the map names, and each line of it that is not an entry."""
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    named, unreadable, folders = set(), [], []
    for line in block.splitlines():
        entry = MAP_ENTRY.match(line)
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent >= DESCRIPTIONS:
            continue
        if entry is None or indent % 2 or indent // 2 > len(folders):
            unreadable.append(line)
            continue
        del folders[indent // 2:]
        path = "".join(folders) + entry.group(2)
        named.add(path)
        if path.endswith("/"):
            folders.append(entry.group(2))
    return named, unreadable


def map_problems(text: str) -> list[str]:
    named, unreadable = mapped_modules(text)
    modules = package_modules()
    return [f"not in the map: {path}" for path in sorted(modules - named)] + \
        [f"in the map, not in the package: {path}" for path in sorted(named - modules)] + \
        [f"not an entry of the map: {line!r}" for line in unreadable]


def test_the_development_map_names_every_module():
    assert map_problems(DEVELOPMENT.read_text()) == []


def test_a_module_missing_from_the_map_is_caught():
    """The failing twin: the map without stacks/meta.py's line, and with a line for a module that is gone."""
    text = DEVELOPMENT.read_text()
    line = next(line for line in text.splitlines() if line.startswith("    meta.py") and "RunSpec" in line)
    planted = text.replace(line + "\n", "").replace("    shard.py", "    gone.py     a module since removed\n"
                                                                       "    shard.py")
    assert map_problems(planted) == ["not in the map: megalign/stacks/meta.py",
                                     "in the map, not in the package: megalign/stacks/gone.py"]



# A script shown whole in the docs is the file a test runs: the line `<!-- the file PATH -->` puts it
# in the fenced block right after it, and the block must be the file as it is. `python -m
# tests.test_docs` writes each file into its block again, after the file changed.
INCLUDE = re.compile(r"^(<!-- the file (\S+) -->\n```\w*\n)(.*?)^```$", re.MULTILINE | re.DOTALL)


def included(text: str) -> list[tuple[str, str]]:
    """(the file's path, the block's text) of every included file in a doc's text."""
    return [(match.group(2), match.group(3)) for match in INCLUDE.finditer(text)]


def include_again(text: str) -> str:
    return INCLUDE.sub(lambda match: match.group(1) + (ROOT / match.group(2)).read_text() + "```", text)


INCLUDED = [(path, file, block) for path in DOCS for file, block in included(path.read_text())]


def test_the_trainer_page_shows_the_scripts_the_tests_run():
    assert {file for path, file, _ in INCLUDED if path.name == "trainer.md"} == {
        "tests/trainer/gpt2_train.py", "tests/trainer/tp_train.py", "tests/trainer/megatron_train.py"}


@pytest.mark.parametrize("path, file, block", INCLUDED, ids=lambda v: str(v).removeprefix(f"{ROOT}/")[:60])
def test_an_included_script_is_the_file_as_it_is(path, file, block):
    assert block == (ROOT / file).read_text(), \
        f"{path.relative_to(ROOT)} shows {file} as it was: run `python -m tests.test_docs` to show it as it is"


def test_a_script_changed_after_it_was_included_is_caught():
    """The failing twin: the page's copy of tp_train.py with one line changed is not the file."""
    text = (ROOT / "docs" / "trainer.md").read_text()
    planted = text.replace("clip_grad_norm(list(model.parameters()), 0.1)", "clip_grad_norm(list(model.parameters()), 1)")
    assert planted != text
    assert [file for file, block in included(planted) if block != (ROOT / file).read_text()] == \
        ["tests/trainer/tp_train.py"]
    assert include_again(planted) == text


if __name__ == "__main__":
    for doc in DOCS:
        doc.write_text(include_again(doc.read_text()))
