"""Shared rendering for the commands: one console, one-line errors, and tables in three formats.

A table is drawn with rich in a terminal; in a pipe, a file or a CI log (or with --no-color /
NO_COLOR) it is plain text aligned to its content, and `markdown` gives a GitHub table for a CI
comment. Cells are never cut. A terminal too narrow for the whole table takes the caller's steps,
in order, until it fits (`_fit`): a column folds onto more lines (between words, so that a number is
never split; a `wraps` column anywhere, down to FOLD_MIN characters), or is left out (a `footnote`
column's cells are then printed under the table). Text from outside (names from a dump, messages
naming them) reaches the terminal through `shown` or `printable` only: it can neither restyle the
terminal nor add a line.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, NoReturn, Optional, Sequence, Union

import typer
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.segment import Segment
from rich.table import Table

class _Console(Console):
    """No colour (--no-color, NO_COLOR) is no style at all: rich's own no_color mode drops the colours
    and still writes bold and the other attributes."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(Segment.strip_styles(buffer) if self.no_color else buffer)


class _Stdout(_Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError  # rich's own exits 1, whatever the verdict: reader_may_leave handles it


console = _Stdout()
err_console = _Console(stderr=True)

FORMATS = ("auto", "table", "plain", "markdown")
FOLD_MIN = 20  # the narrowest a `wraps` column folds to: a long name stays readable, a few lines tall
GAP = 2  # characters between two columns of the terminal table, as in plain text
# A step that narrows a terminal table: (column header, DROP, FOLD or a width to fold down to at most).
DROP, FOLD = "drop", "fold"
Step = tuple[str, Union[str, int]]


def fail(message: str, code: int) -> NoReturn:
    """Print `error: message` in red on stderr and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {shown(message)}", highlight=False, soft_wrap=True)
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


def shown(text: str) -> str:
    """Text from outside (a name from a dump, a message naming one) as rich markup: printable, markup escaped."""
    return escape(printable(text))


def printable(text: str) -> str:
    """`text` with every character a terminal acts on (ESC, a newline, ...) written as a Python string
    literal writes it (`\\x1b`, `\\n`): a name from a dump would otherwise restyle the terminal, or put a
    line of its own into the report."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def use_color(no_color: bool) -> None:
    """--no-color (or NO_COLOR, which rich reads itself) turns every style off on both consoles."""
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
    wraps: bool = False  # may fold anywhere (a long name), not only between words
    footnote: bool = False  # when left out of a narrow terminal's table, its cells are printed under it


@dataclass(frozen=True)
class Cell:
    text: str
    style: Optional[str] = None  # rich style, used by the terminal table only


def print_table(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], fmt: str,
                highlight: Optional[int] = None, narrowing: Sequence[Step] = ()) -> None:
    """Print `rows` as `fmt` (table, plain or markdown); `highlight` is the index of a row to mark;
    `narrowing`: the steps a terminal table takes, in order, while it is too wide. A terminal too
    narrow for the table after every step gets plain text, whose long lines it wraps: rich would
    squeeze the columns further and split numbers."""
    rows = [[replace(cell, text=printable(cell.text)) for cell in row] for row in rows]  # names from a dump
    widths = _fit(columns, rows, console.width, narrowing) if fmt == "table" else []
    if fmt == "table" and _width(widths) <= console.width:
        console.print(_rich_table(columns, rows, widths, highlight))
        _footnotes(columns, rows, widths)
    elif fmt == "markdown":
        print(_markdown(columns, rows))
    else:
        print(_plain(columns, rows))


def _width(widths: Sequence[Optional[int]]) -> int:
    kept = [w for w in widths if w is not None]
    return sum(kept) + GAP * (len(kept) - 1)


def _fit(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int,
         narrowing: Sequence[Step]) -> list[Optional[int]]:
    """Each column's width in a terminal `width` wide, None where it is left out: the whole cells
    where they fit, else after as many of the `narrowing` steps as it takes."""
    texts = [[column.header] + [row[i].text for row in rows] for i, column in enumerate(columns)]
    widths: list[Optional[int]] = [max(map(cell_len, t)) for t in texts]
    headers = [column.header for column in columns]
    for header, step in narrowing:
        excess = _width(widths) - width
        if excess <= 0:
            break
        i = headers.index(header)
        if widths[i] is None or step == DROP:
            widths[i] = None
            continue
        least = _narrowest(columns[i], texts[i])
        least = least if step == FOLD else max(step, least)
        widths[i] = min(widths[i], max(least, widths[i] - excess))
    return widths


def _narrowest(column: Column, texts: list[str]) -> int:
    """How narrow a column folds: its longest word, which is never split; a `wraps` column FOLD_MIN."""
    longest = max(cell_len(word) for text in texts for word in text.split(" "))
    return min(longest, FOLD_MIN) if column.wraps else longest


def _rich_table(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], widths: Sequence[Optional[int]],
                highlight: Optional[int]) -> Table:
    table = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, GAP - 1, 0, 0))
    kept = [i for i, w in enumerate(widths) if w is not None]
    for i in kept:
        table.add_column(columns[i].header, justify="right" if columns[i].right else "left", overflow="fold",
                         width=widths[i])
    for index, row in enumerate(rows):
        cells = [f"[{c.style}]{escape(c.text)}[/]" if c.style else escape(c.text) for c in (row[i] for i in kept)]
        table.add_row(*cells, style="on grey23" if index == highlight else None)
    return table


def _footnotes(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], widths: Sequence[Optional[int]]) -> None:
    """The cells of the footnote columns left out, under the table, each after its row's first cell."""
    for i, column in enumerate(columns):
        cells = [(row[0].text, row[i].text) for row in rows if row[i].text]
        if column.footnote and widths[i] is None and cells:
            console.print(f"{column.header}s (no room in the table):", highlight=False)
            for label, text in cells:
                console.print(f"  {escape(label)}: {escape(text)}", highlight=False)


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
