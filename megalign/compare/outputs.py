"""Where compare may write its reports: every output path is checked before the comparison starts.

An output inside either input would overwrite part of a dump (or a user's tensor file), so it is
refused; so is a path whose folder does not exist, a folder, something other than a regular file
(/dev/full, a FIFO), two outputs on one path, and a plot whose suffix matplotlib cannot write. A
--json or --export-worst path must be new, empty, or a file of that option's kind that megalign
wrote (`Output.ours`): another dump's manifest, a user's notes are never replaced.
Each report is written to a temporary file beside its path and renamed into place: a path that is
a hard link to another file (a dump's manifest) gets a new file, and the other keeps its content.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megalign.errors import UserError

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


@dataclass(frozen=True)
class Output:
    """A file compare writes: its option, its path (None when not given), and what an existing file there
    must be to be replaced: `ours(path)` tells one megalign wrote, `kind` names it (None: any file)."""

    option: str
    path: Optional[Path]
    ours: Optional[Callable[[Path], bool]] = None
    kind: str = ""


def check_outputs(outputs: list[Output], inputs: list[Path]) -> None:
    """UserError for the first bad output."""
    seen: dict[Path, str] = {}
    for output in outputs:
        option, path = output.option, output.path
        if path is None:
            continue
        resolved = path.resolve()
        for source in inputs:
            source = source.resolve()
            if resolved == source or resolved.is_relative_to(source):
                raise UserError(f"{option} {path} is inside the input {source}: refusing to write into a dump")
        if resolved in seen:
            raise UserError(f"{option} {path} is also the {seen[resolved]} path")
        seen[resolved] = option
        if path.is_dir():
            raise UserError(f"{option} {path} is a folder; give a file path")
        if path.exists() and not path.is_file():
            raise UserError(f"{option} {path} is not a regular file; give a file path")
        if not resolved.parent.is_dir():
            raise UserError(f"{option} {path}: folder {resolved.parent} does not exist")
        if option == "--plot" and path.suffix.lower() not in PLOT_SUFFIXES:
            raise UserError(f"--plot {path}: the file name must end in {', '.join(PLOT_SUFFIXES)}")
        _check_replaceable(output)


def _check_replaceable(output: Output) -> None:
    """An existing file is replaced only when it holds nothing (a `mktemp`'s) or is provably megalign's."""
    path = output.path
    if output.ours is None or not path.exists() or path.stat().st_size == 0 or output.ours(path):
        return
    raise UserError(f"{output.option} {path} exists and is not a megalign {output.kind}; give a new path (only a "
                    f"{output.kind} that megalign wrote is replaced)")


def write_replacing(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a new file beside `path`, then rename it onto `path`; nothing is left on failure."""
    tmp = path.with_name(f".{path.name}.megalign-{os.getpid()}{path.suffix}")  # the suffix tells matplotlib the format
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
