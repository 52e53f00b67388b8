"""The package's imports run one way: cli -> run -> stacks -> dump, and cli -> compare -> dump; the
public Python API (`megalign.open` in compare/opened.py, `megalign.Dumper` in dump/dumper.py) is
re-exported lazily by `megalign` itself.

Every import statement of every module is read (function-local ones too, which is where the heavy
imports hide), and each arrow against the rule fails the test, naming the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megalign

PACKAGE = Path(megalign.__file__).parent
# The layout module (Layout and its rules) is base: the run's spec holds a Layout, both sides use it.
BASE = {"megalign", "megalign.spec", "megalign.options", "megalign.errors", "megalign.dump.layout"}
# Which parts each part may import, besides itself and the base modules.
# transformers' stack must not pay megatron-core's import. megatron's loads Hugging Face checkpoints
# through stacks/hf's checkpoint reader (torch and safetensors: transformers is imported by the HF
# worker alone). run/ starts workers through stacks/'s registry (stacks/__init__.py), never
# megatron's modules; it reads an --hf checkpoint to plan a run.
STACKS = {"stacks", "stacks.megatron", "stacks.hf"}
ALLOWED = {
    "cli": {"run", "dump", "compare", *STACKS},
    "run": {"dump", "stacks", "stacks.hf"},
    "stacks.megatron": {"dump", "stacks", "stacks.hf"},
    "stacks.hf": {"dump", "stacks"},
    "stacks": {"dump"},
    "dump": set(),
    "compare": {"dump"},
}


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
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "megalign"]


def imported_module(name: str) -> str:
    """`from a.b import c` names a.b.c, which is a module or a name in a.b: the longest module prefix."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = PACKAGE.parent.joinpath(*parts[:end])
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts[:end])
    return name


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(module_name(path))
        for line, name in imports(path):
            target = part_of(imported_module(name))
            if target in ("base", source):
                continue
            if source == "base":
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module_name(path)} imports nothing of "
                             f"megalign, but imports {name}")
            elif target not in ALLOWED[source]:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {source} -> {target} ({name})")
    return found


def test_imports_run_one_way():
    assert violations() == []


@pytest.mark.parametrize("where, line, expected", [
    ("compare", "from megalign.run.launch import launch", "compare -> run (megalign.run.launch.launch)"),
    ("stacks/hf", "from megalign.stacks.megatron import model",
     "stacks.hf -> stacks.megatron (megalign.stacks.megatron.model)"),
])
def test_a_backward_arrow_is_caught(where, line, expected):
    """The failing twin: a planted import against the rule is reported with its file and line."""
    planted = PACKAGE / where / "_planted_import.py"
    planted.write_text(f"def f():\n    {line}\n")
    try:
        found = violations()
    finally:
        planted.unlink()
    assert found == [f"megalign/{where}/_planted_import.py:2: {expected}"]
