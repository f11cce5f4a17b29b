"""Tables for a terminal: readable at 80 columns by default, whole with ``--wide``.

A table is declared as `Column`s over rows of plain dicts. The narrow view (the default)
shows only the columns an operator needs first (and of those only the ones with
something to show), cuts each cell to its column's `max_width` with an ellipsis, and
fits the table to the terminal: when it is still too wide the `flex` columns (long
free text such as an error) give way first, widest first, then the others, never below
their header. So a cell is cut, never folded one character per line. The wide view
shows every column, nothing cut, on a console as wide as the table needs (pipe it to
``less -S``). The commands' ``--json`` prints the rows themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

ELLIPSIS = "…"
GAP = 3  # between two columns: a space, the column rule, a space
MIN_WIDTH = 3  # no column is fitted narrower than its header or this

Cell = str | Text


@dataclass(frozen=True)
class Column:
    """One column: the row key it shows, its header and how the narrow view treats it.

    `max_width` cuts longer cells in the narrow view (None: only the terminal limits it);
    `flex` columns give way first when the table must shrink to fit; `wide_only` columns
    appear with ``--wide`` alone. `show` turns a row's value into the cell (default:
    `cell_text`).
    """

    key: str
    header: str = ""
    max_width: int | None = None
    flex: bool = False
    wide_only: bool = False
    justify: Literal["left", "right"] = "left"
    show: Callable[[Any], Cell] | None = None

    @property
    def title(self) -> str:
        return self.header or self.key.replace("_", " ")

    def cell(self, row: Mapping[str, Any]) -> Cell:
        value = row.get(self.key)
        return self.show(value) if self.show else cell_text(value)


def cell_text(value: Any) -> str:
    """A value as a cell: nothing for a missing value, floats without noise."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def truncate(cell: Cell, width: int | None) -> Cell:
    """`cell` cut to `width` characters, its last one an ellipsis when anything was cut."""
    if width is None or len(cell) <= width:
        return cell
    if isinstance(cell, Text):
        cut = cell.copy()
        cut.truncate(width, overflow="ellipsis")
        return cut
    return cell[: max(0, width - 1)] + ELLIPSIS


def fit_widths(
    natural: Sequence[int], minimum: Sequence[int], flex: Sequence[bool], budget: int
) -> list[int]:
    """Column widths summing to at most `budget` where possible (pure).

    Flex columns shrink first, then the others; within each kind the widest column
    loses a character at a time, so narrow columns keep their text. No column goes
    below its `minimum`; if the minimums alone exceed the budget they are the answer.
    """
    widths = list(natural)
    for shrinking in (True, False):
        while sum(widths) > budget:
            room = [i for i, w in enumerate(widths) if flex[i] == shrinking and w > minimum[i]]
            if not room:
                break
            widest = max(room, key=lambda i: widths[i])
            widths[widest] -= 1
    return widths


def build(
    columns: Sequence[Column],
    rows: Iterable[Mapping[str, Any]],
    *,
    wide: bool = False,
    width: int = 80,
    title: str | None = None,
) -> Table:
    """The rich Table of `rows`: the narrow view fitted to `width`, or the wide view."""
    rows = list(rows)
    shown = [c for c in columns if wide or not c.wide_only]
    cells = [[c.cell(r) for c in shown] for r in rows]
    if not wide:  # a column with nothing to show costs width and says nothing
        keep = [j for j in range(len(shown)) if any(len(row[j]) for row in cells)]
        shown = [shown[j] for j in keep]
        cells = [
            [truncate(row[j], shown[n].max_width) for n, j in enumerate(keep)] for row in cells
        ]
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    if wide:
        for c in shown:
            table.add_column(c.title, justify=c.justify, no_wrap=True)
    else:
        natural = [
            max([len(c.title), *(len(row[j]) for row in cells)]) for j, c in enumerate(shown)
        ]
        minimum = [min(natural[j], max(MIN_WIDTH, len(c.title))) for j, c in enumerate(shown)]
        budget = width - GAP * max(0, len(shown) - 1)
        fitted = fit_widths(natural, minimum, [c.flex for c in shown], budget)
        for c, w in zip(shown, fitted, strict=True):
            table.add_column(
                truncate(c.title, w), justify=c.justify, no_wrap=True, overflow="ellipsis", width=w
            )
        cells = [[truncate(x, w) for x, w in zip(row, fitted, strict=True)] for row in cells]
    for row in cells:
        table.add_row(*(x if isinstance(x, Text) else Text(x) for x in row))
    return table


def print_tables(
    make: Callable[[int], Sequence[Table]], *, wide: bool = False, console: Console | None = None
) -> None:
    """Print the tables `make(width)` builds for the terminal's width; wide, on a console
    as wide as the widest table needs so that no cell is cut or folded."""
    out = console or Console()
    tables = make(out.width)
    if wide:
        unbounded = out.options.update(max_width=1 << 20)
        need = max((out.measure(t, options=unbounded).maximum for t in tables), default=0)
        if need > out.width:
            out = Console(width=need, file=out.file, force_terminal=out.is_terminal)
    for t in tables:
        out.print(t)
