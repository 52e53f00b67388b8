"""The package's imports run one way: cli -> run -> stacks -> capture -> dump, and cli -> compare -> dump;
the public Python API (`megalign.open` in compare/opened.py, `megalign.Dumper` in capture/dumper.py) is
re-exported lazily by `megalign` itself.

Every import statement of every module is read (function-local ones and those under TYPE_CHECKING too,
which is where the heavy imports and the circles hide), and the test fails, naming the file and line, on
- an arrow against the parts' rule (ALLOWED);
- a module of dump/ (the format) importing anything of megalign outside dump/ but megalign.errors;
- the run commands (forward, backward) reaching compare/, however far round: a run reads its inputs
  (tokens, rollouts, a dump's recorded routing) through run/ and the layers below it;
- a circle: modules that import each other, however far round (a function-level import hides a circle
  from Python's import machinery, not from the design).
"""

from __future__ import annotations

import ast
import functools
from contextlib import contextmanager
from pathlib import Path

import pytest

import megalign

PACKAGE = Path(megalign.__file__).parent
# The layout module (Layout and its rules) is base: the run's spec holds a Layout, both sides use it.
# sizes: the byte sizes a run and a zoom print.
BASE = {"megalign", "megalign.spec", "megalign.options", "megalign.errors", "megalign.sizes", "megalign.dump.layout"}
# Which parts each part may import, besides itself and the base modules.
# transformers' stack must not pay megatron-core's import. megatron's loads Hugging Face checkpoints
# through stacks/hf's checkpoint reader (torch and safetensors: transformers is imported by the HF
# worker alone). run/ starts workers through stacks/'s registry (stacks/__init__.py), never
# megatron's modules; it reads an --hf checkpoint to plan a run. rollouts/ (engines' rollout files)
# is read by both sides: a run's tokens, compare's logprobs; options.py names its formats in --help.
STACKS = {"stacks", "stacks.megatron", "stacks.hf"}
ALLOWED = {
    "base": {"rollouts"},
    "cli": {"run", "dump", "compare", "rollouts", *STACKS},
    "run": {"dump", "stacks", "stacks.hf", "rollouts"},
    "stacks.megatron": {"capture", "dump", "stacks", "stacks.hf"},
    "stacks.hf": {"capture", "dump", "stacks"},
    "stacks": {"capture", "dump"},
    "capture": {"dump"},
    "dump": set(),
    "compare": {"dump", "rollouts"},
    "rollouts": set(),
}
# The format imports nothing above it: what it may import besides its own modules.
DUMP_MAY_IMPORT = {"megalign.errors"}
# forward and backward's modules: what they reach, however far round, holds nothing of compare/.
RUN_COMMANDS = ("megalign.cli.run", "megalign.cli.forward", "megalign.cli.backward")


def part_of(module: str) -> str:
    """'megalign.stacks.hf.stack' -> 'stacks.hf'; base modules -> 'base'."""
    if module in BASE:
        return "base"
    if module == "megalign.__main__":
        return "cli"
    rest = module.removeprefix("megalign.").split(".")
    if rest[0] == "stacks" and len(rest) > 2:
        return f"stacks.{rest[1]}"
    return rest[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import of megalign in `path`, relative ones made absolute."""
    stat = path.stat()
    return _imports(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _imports(path: Path, mtime_ns: int, size: int) -> list[tuple[int, str]]:
    """Each file parsed once a session while unchanged (by its time and size): the twins plant files."""
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level \
                else node.module
            found += [(node.lineno, f"{base.rstrip('.')}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "megalign"]


def imported_module(name: str) -> str:
    """`from a.b import c` names a.b.c, which is a module or a name in a.b: the longest module prefix."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = PACKAGE.parent.joinpath(*parts[:end])
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts[:end])
    return name


def import_graph() -> dict[str, dict[str, tuple[str, int, str]]]:
    """module -> {imported module: (file, line, what the statement names)}, the first statement of each arrow."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source, arrows = module_name(path), {}
        for line, name in imports(path):
            target = imported_module(name)
            if target != source:
                arrows.setdefault(target, (str(path.relative_to(PACKAGE.parent)), line, name))
        graph[source] = arrows
    return graph


def violations() -> list[str]:
    found = []
    for source, arrows in import_graph().items():
        for target, (where, line, name) in arrows.items():
            source_part, target_part = part_of(source), part_of(target)
            if target_part in ("base", source_part):
                continue
            if source_part not in ALLOWED:
                found.append(f"{where}:{line}: {source_part} is a part tests/test_imports.py does not know: "
                             "give it a line in ALLOWED")
            elif target_part not in ALLOWED[source_part]:
                found.append(f"{where}:{line}: {source_part} -> {target_part} ({name})")
    return found


def dump_arrows_up() -> list[str]:
    """Each import by a dump/ module of anything of megalign outside dump/ and DUMP_MAY_IMPORT."""
    return [f"{where}:{line}: dump/ imports {name}"
            for source, arrows in import_graph().items() if source.startswith("megalign.dump.")
            for target, (where, line, name) in arrows.items()
            if not target.startswith("megalign.dump.") and target not in DUMP_MAY_IMPORT]


def run_commands_reaching_compare(commands: tuple[str, ...] = RUN_COMMANDS) -> list[str]:
    """Each import of a compare/ module by a module the commands reach: the arrow, and how far round."""
    graph, found = import_graph(), []
    path = {module: [module] for module in commands}
    frontier = list(commands)
    while frontier:
        following = []
        for module in frontier:
            for target, (where, line, name) in graph.get(module, {}).items():
                if part_of(target) == "compare":
                    found.append(f"{where}:{line}: {' -> '.join(path[module])} imports {name}")
                elif target not in path:
                    path[target] = path[module] + [target]
                    following.append(target)
        frontier = following
    return found


def circles() -> list[str]:
    """One line per circle of modules importing each other (a strongly connected part of the graph of
    two or more modules), naming each arrow of one way round it by its file and line."""
    graph = import_graph()
    return [" -> ".join(f"{module} ({graph[module][after][0]}:{graph[module][after][1]})"
                        for module, after in zip(circle, circle[1:])) + f" -> {circle[0]}"
            for circle in (_way_round(graph, component) for component in _strongly_connected(graph))]


def _strongly_connected(graph: dict[str, dict]) -> list[list[str]]:
    """Tarjan's components of two or more modules, iteratively (no recursion limit to meet)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next((t for t in targets if t in graph), None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _way_round(graph: dict[str, dict], component: list[str]) -> list[str]:
    """A shortest walk from the component's first module back to itself, inside the component."""
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in graph[module]:
                if target == start:
                    return paths[module] + [start]
                if target in component and target not in paths:
                    paths[target] = paths[module] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{component} is no circle")


def test_imports_run_one_way():
    assert violations() == []


def test_dump_imports_nothing_above_it():
    assert dump_arrows_up() == []


def test_the_run_commands_never_reach_compare():
    assert run_commands_reaching_compare() == []


def test_no_import_circles():
    assert circles() == []


@contextmanager
def planted(files: dict[str, str]):
    """Each `where/name.py` written under the package for the length of the `with`."""
    try:
        for where, text in files.items():
            (PACKAGE / where).write_text(text)
        yield
    finally:
        for where in files:
            (PACKAGE / where).unlink(missing_ok=True)


@pytest.mark.parametrize("where, line, expected", [
    ("compare", "from megalign.run.launch import launch", "compare -> run (megalign.run.launch.launch)"),
    ("stacks/hf", "from megalign.stacks.megatron import model",
     "stacks.hf -> stacks.megatron (megalign.stacks.megatron.model)"),
])
def test_a_backward_arrow_is_caught(where, line, expected):
    """The failing twin: a planted import against the rule is reported with its file and line."""
    with planted({f"{where}/_planted_import.py": f"def f():\n    {line}\n"}):
        found = violations()
    assert found == [f"megalign/{where}/_planted_import.py:2: {expected}"]


@pytest.mark.parametrize("line", ["from megalign.spec import RunSpec",
                                  "if TYPE_CHECKING:\n    from megalign.spec import RunSpec",
                                  "def f():\n    from megalign import __version__"])
def test_dump_importing_above_it_is_caught(line):
    """The failing twin: dump/ naming the run's spec (dump/meta.py did), even for type checking only, or the
    package's root."""
    with planted({"dump/_planted_import.py": f"{line}\n"}):
        found = dump_arrows_up()
    assert len(found) == 1 and found[0].startswith("megalign/dump/_planted_import.py:") and \
        found[0].endswith(("megalign.spec.RunSpec", "megalign.__version__")), found


def test_the_run_commands_reaching_compare_is_caught():
    """The failing twin: a run command reaching compare/ two arrows round, inside a function (cli/run.py
    read --routing replay through compare/replay.py)."""
    with planted({"cli/_planted_run.py": "from megalign.run import _planted_a\n",
                  "run/_planted_a.py": "from megalign.stacks import _planted_b\n",
                  "stacks/_planted_b.py": "def f():\n    from megalign.compare.lineup import line_up\n"}):
        found = run_commands_reaching_compare(("megalign.cli._planted_run",))
    assert found == ["megalign/stacks/_planted_b.py:2: megalign.cli._planted_run -> megalign.run._planted_a -> "
                     "megalign.stacks._planted_b imports megalign.compare.lineup.line_up"]


def test_a_circle_is_caught():
    """The failing twin: two modules of one part importing each other, one of them inside a function (as
    cli/run.py imported cli/app.py), and a third joining them through a relative import."""
    with planted({"compare/_planted_a.py": "from megalign.compare import _planted_b\n",
                  "compare/_planted_b.py": "def f():\n    from . import _planted_c\n",
                  "compare/_planted_c.py": "import megalign.compare._planted_a\n"}):
        found = circles()
    assert found == ["megalign.compare._planted_a (megalign/compare/_planted_a.py:1) -> "
                     "megalign.compare._planted_b (megalign/compare/_planted_b.py:2) -> "
                     "megalign.compare._planted_c (megalign/compare/_planted_c.py:1) -> megalign.compare._planted_a"]
