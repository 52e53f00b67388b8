"""Shared rendering for the commands: one console, one-line errors, and tables in three formats.

A table is drawn with rich in a terminal; in a pipe, a file or a CI log (or with --no-color /
NO_COLOR) it is plain text aligned to its content, and `markdown` gives a GitHub table for a CI
comment. Cells are never cut: a narrow terminal wraps the long ones.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator, NoReturn, Optional, Sequence

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError  # rich's own exits 1, whatever the verdict: reader_may_leave handles it


console = _Console()
err_console = Console(stderr=True)

FORMATS = ("auto", "table", "plain", "markdown")


def fail(message: str, code: int) -> NoReturn:
    """Print `error: message` in red on stderr and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """`megalign compare A B | head -3`: a reader that closes the pipe ends the printing, not the
    command, whose exit code stays its verdict's (click would exit 1)."""
    try:
        yield
    except BrokenPipeError:
        # What is still buffered is flushed again at exit: into /dev/null, quietly.
        console.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def use_color(no_color: bool) -> None:
    """--no-color (or NO_COLOR, which rich reads itself) turns styles off on both consoles."""
    if no_color:
        console.no_color = err_console.no_color = True


def resolve_format(fmt: str) -> str:
    """auto: rich's table in a colour terminal, plain text anywhere else."""
    if fmt != "auto":
        return fmt
    plain = not console.is_terminal or console.no_color or bool(os.environ.get("NO_COLOR"))
    return "plain" if plain else "table"


@dataclass(frozen=True)
class Column:
    header: str
    right: bool = False  # numbers align right
    wraps: bool = False  # a long cell may fold onto more lines in a narrow terminal


@dataclass(frozen=True)
class Cell:
    text: str
    style: Optional[str] = None  # rich style, used by the terminal table only


def print_table(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], fmt: str,
                highlight: Optional[int] = None) -> None:
    """Print `rows` as `fmt` (table, plain or markdown); `highlight` is the index of a row to mark."""
    if fmt == "table":
        console.print(_rich_table(columns, rows, highlight))
    elif fmt == "markdown":
        print(_markdown(columns, rows))
    else:
        print(_plain(columns, rows))


def _rich_table(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], highlight: Optional[int]) -> Table:
    table = Table(header_style="bold", pad_edge=False, box=box.SIMPLE_HEAD)
    for column in columns:
        table.add_column(column.header, justify="right" if column.right else "left", overflow="fold",
                         no_wrap=not column.wraps)
    for index, row in enumerate(rows):
        cells = [f"[{c.style}]{escape(c.text)}[/]" if c.style else escape(c.text) for c in row]
        table.add_row(*cells, style="on grey23" if index == highlight else None)
    return table


def _plain(columns: Sequence[Column], rows: Sequence[Sequence[Cell]]) -> str:
    texts = [[c.header for c in columns]] + [[cell.text for cell in row] for row in rows]
    widths = [max(len(line[i]) for line in texts) for i in range(len(columns))]

    def line(cells: list[str]) -> str:
        return "  ".join(text.rjust(w) if column.right else text.ljust(w)
                         for text, w, column in zip(cells, widths, columns)).rstrip()

    return "\n".join([line(texts[0]), "  ".join("-" * w for w in widths)] + [line(t) for t in texts[1:]])


def _markdown(columns: Sequence[Column], rows: Sequence[Sequence[Cell]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(text.replace("|", "\\|") for text in cells) + " |"

    rule = "|" + "|".join("---:" if c.right else "---" for c in columns) + "|"
    return "\n".join([line([c.header for c in columns]), rule] + [line([cell.text for cell in row]) for row in rows])
