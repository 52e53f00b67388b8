"""Where compare may write its reports: every output path is checked before the comparison starts.

An output inside either input would overwrite part of a dump (or a user's tensor file), so it is
refused; so is a path whose folder does not exist, a folder, something other than a regular file
(/dev/full, a FIFO), two outputs on one path, and a plot whose suffix matplotlib cannot write.
Each report is written to a temporary file beside its path and renamed into place: a path that is
a hard link to another file (a dump's manifest) gets a new file, and the other keeps its content.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from megalign.errors import UserError

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_outputs(outputs: dict[str, Optional[Path]], inputs: list[Path]) -> None:
    """`outputs`: option name -> path (None when not given). UserError for the first bad one."""
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
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


def write_replacing(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a new file beside `path`, then rename it onto `path`; nothing is left on failure."""
    tmp = path.with_name(f".{path.name}.megalign-{os.getpid()}{path.suffix}")  # the suffix tells matplotlib the format
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
