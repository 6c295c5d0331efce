"""Tables the CLI prints, fitted to the terminal without ever cutting a cell.

Operators copy session ids and chunk keys out of `ls` and `inspect`; a table that shows `cus…`
or one fingerprint on every row is worse than none. So a table drops the columns a reader needs
least until the rest fit the console's width, and where even the columns it must keep do not fit
(a 99-character chunk key at 80 columns), each row becomes a block of `name value` lines whose long
values the terminal wraps. `--json` is the interface for scripts; this is for people.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table


@dataclass(frozen=True)
class Column:
    name: str
    drop: int = 0
    """order in which the column goes when the table is too wide: higher goes first; 0 never goes"""
    right: bool = False
    """numbers are right-aligned"""


def table_width(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> int:
    """Columns a rich table with the default box takes for these cells, none cut: each column is
    its widest cell plus a space either side and a rule, plus the closing rule."""
    widths = [max([cell_len(c.name), *(cell_len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    return sum(widths) + 3 * len(widths) + 1


def fitted(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> list[int] | None:
    """Indices of the columns to show at `width`: all, or all but the most droppable ones; None
    when even the columns that never go do not fit (then a vertical layout)."""
    keep = list(range(len(columns)))
    for i in sorted((i for i, c in enumerate(columns) if c.drop), key=lambda i: -columns[i].drop):
        if table_width([columns[j] for j in keep], [[r[j] for j in keep] for r in rows]) <= width:
            return keep
        keep.remove(i)
    return keep if table_width([columns[j] for j in keep], [[r[j] for j in keep] for r in rows]) <= width else None


def print_table(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """Print `rows` (plain text cells, no markup) as wide as the console allows, no cell cut."""
    keep = fitted(columns, rows, console.width)
    if keep is None:
        _print_blocks(console, columns, rows)
        return
    table = Table()
    for j in keep:
        c = columns[j]
        table.add_column(c.name, justify="right" if c.right else "left", no_wrap=True, overflow="fold")
    for r in rows:
        table.add_row(*(escape(r[j]) for j in keep))
    console.print(table)
    dropped = [columns[j].name for j in range(len(columns)) if j not in keep]
    if dropped and rows:
        console.print(f"(narrow terminal: {', '.join(dropped)} not shown; --json has every field)", markup=False)


def _print_blocks(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """One block per row: the first cell on a line of its own, then one `name value` line per other
    cell; nothing is cut (a value wider than the terminal is wrapped by the terminal)."""
    pad = max(cell_len(c.name) for c in columns[1:]) if len(columns) > 1 else 0
    for n, r in enumerate(rows):
        if n:
            console.print()
        console.print(f"{columns[0].name} {r[0]}", markup=False, highlight=False, soft_wrap=True)
        for c, cell in zip(columns[1:], r[1:]):
            console.print(f"  {c.name.ljust(pad)}  {cell}", markup=False, highlight=False, soft_wrap=True)
