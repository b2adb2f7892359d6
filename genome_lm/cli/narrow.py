"""Output that reads at 80 columns and through a pipe (rich then renders at 80 columns).

Left to itself, rich fits a table that is too wide by narrowing its widest columns, below their
widest word if it must, and ends each cut word with "…": parity's 11 columns read as nothing but
ellipses, eval's buckets as "1,024-2,…". And it breaks a long line of text where the width ends,
so a command printed for the reader to copy (``mlflow ui --backend-store-uri ...``) came out on
two lines. The CLI's console (``base.make_console``) has both fixed here, for every command:

- ``FitTables`` (a render hook): a table whose columns cannot all keep their widest word is
  printed as several tables of fewer columns, each repeating the first (label) column; every
  column is kept at least as wide as its widest word, and a word wider than the console folds
  onto the next line instead of ending in "…".
- ``WholeLines`` (the console): a line of text prints whole; the terminal folds it at its edge,
  a pipe or file gets it on one line.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from math import ceil

from rich.console import Console, ConsoleOptions, RenderHook, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

# a width no table reaches: a table measured against it gives its own narrowest and widest,
# where the console's width would clamp them
_UNBOUNDED = 1 << 20


class WholeLines(Console):
    """A console that prints lines of text soft-wrapped (never broken by rich) and everything else
    as rich does. Console(soft_wrap=True) would do it for all: a table's title and caption would
    then run past the width unbroken, and Live's redraws (``console.status``) would not be cut to
    the width, so a long status line would leave copies of itself behind."""

    def print(self, *objects, soft_wrap: bool | None = None, **kwargs) -> None:
        if soft_wrap is None:
            soft_wrap = all(isinstance(obj, (str, Text)) for obj in objects)
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)


class FitTables(RenderHook):
    """Every table printed through the console is rendered by ``Fitted``, which knows the width."""

    def process_renderables(self, renderables):
        return [Fitted(r) if isinstance(r, Table) else r for r in renderables]


class Fitted:
    """A table as one or more tables that fit the width they are rendered at (``fit``)."""

    def __init__(self, table: Table):
        self.table = table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from fit(self.table, console, options)


def fit(table: Table, console: Console, options: ConsoleOptions) -> list[Table]:
    """``table`` unchanged when its longest lines fit ``options.max_width``; otherwise copies of it
    (``_groups``: several when its columns do not all fit beside each other), each column of
    each given a width no narrower than its widest word (``_widths``)."""
    width = options.max_width
    if _measure(table, console, options).maximum <= width:
        return [table]
    ranges = [_column_range(table, column, console, options) for column in table.columns]
    groups = _groups(table, ranges, console, options, width)
    parts = []
    for index, group in enumerate(groups):
        part = _part(table, [0, *group], index, len(groups))
        room = width - _overhead(part, console, options)
        widths = _widths([ranges[i] for i in [0, *group]], room)
        # fixed widths: rich would narrow the widest columns first whatever their words, so even a
        # table whose words all fit lost some ("1,024-2,…" beside columns that had room to spare)
        part.columns = [replace(column, width=w, overflow=_overflow(column))
                        for column, w in zip(part.columns, widths)]
        parts.append(part)
    return parts


def _measure(table: Table, console: Console, options: ConsoleOptions) -> Measurement:
    return Measurement.get(console, options.update_width(_UNBOUNDED), table)


def _column_range(table: Table, column: Column, console: Console, options: ConsoleOptions) -> tuple[int, int]:
    """How narrow ``column``'s text can be, its widest word (its longest line where its author
    keeps it on one line: no_wrap), and how wide, its longest line; header and footer included
    where shown, bounded as the table bounds it, without padding."""
    if column.width is not None:
        return column.width, column.width
    cells = [column.header] * table.show_header + list(column.cells) + [column.footer] * table.show_footer
    sizes = [Measurement.get(console, options.update_width(_UNBOUNDED), cell) for cell in cells]
    lo, hi = max((m.minimum for m in sizes), default=1), max((m.maximum for m in sizes), default=1)
    return tuple(Measurement(hi if column.no_wrap else lo, hi).clamp(column.min_width, column.max_width))


def _overhead(table: Table, console: Console, options: ConsoleOptions) -> int:
    """What ``table`` adds to its columns' text, padding and borders: its width with every column
    0 wide."""
    bare = copy.copy(table)
    bare.columns = [replace(column, width=0) for column in table.columns]
    return _measure(bare, console, options).minimum


def _groups(table: Table, ranges: list[tuple[int, int]], console: Console, options: ConsoleOptions,
            width: int) -> list[list[int]]:
    """The columns after the first (their indices) in groups, in order, each as many as fit
    ``width`` beside the first column without narrowing a word (one at least). The groups share
    the columns out evenly when they can (4, 4 and 3 columns rather than 5, 5 and 1)."""
    rest = range(1, len(table.columns))

    def fits(group: list[int]) -> bool:
        narrowest = sum(ranges[i][0] for i in [0, *group])
        return _overhead(_part(table, [0, *group]), console, options) + narrowest <= width

    def share(most: int) -> list[list[int]]:
        found = [[]]
        for i in rest:
            if found[-1] and (len(found[-1]) == most or not fits([*found[-1], i])):
                found.append([])
            found[-1].append(i)
        return found

    greedy = share(len(rest))
    even = share(ceil(len(rest) / len(greedy)))
    return even if len(even) == len(greedy) else greedy


def _part(table: Table, columns: list[int], index: int = 0, count: int = 1) -> Table:
    """A copy of ``table`` with only ``columns`` (their indices) and every row; the parts after
    the first say in their title that they continue it, and the caption goes under the last."""
    part = copy.copy(table)  # rows, styles, box: shared with the table, which is not changed
    part.columns = [replace(table.columns[c], _index=i) for i, c in enumerate(columns)]
    if index > 0:
        part.title = _continued(table.title)
    if index < count - 1:
        part.caption = None
    return part


def _continued(title: str | Text | None) -> str | Text:
    if title is None:
        return "(continued)"
    return title + " (continued)" if isinstance(title, Text) else f"{title} (continued)"


def _widths(ranges: list[tuple[int, int]], room: int) -> list[int]:
    """Column widths that add up to at most ``room``: the widest columns are narrowed to a common
    level first, none below its widest word; only where a word is wider than the room do the
    widest columns go on narrowing (folding that word), the others kept whole."""
    widths = _level([hi for _, hi in ranges], [lo for lo, _ in ranges], room)
    return _level(widths, [1] * len(widths), room)


def _level(widths: list[int], floors: list[int], room: int) -> list[int]:
    """``widths`` cut down to the highest common level at which they add up to ``room`` (each
    kept at its floor at least)."""
    def at(level: int) -> list[int]:
        return [max(floor, min(width, level)) for width, floor in zip(widths, floors)]

    level = max(widths)
    while level > 1 and sum(at(level)) > room:
        level -= 1
    return at(level)


def _overflow(column: Column):
    """"fold" for a column left at rich's defaults; its own for one whose author set no_wrap or an
    overflow."""
    return "fold" if column.overflow == "ellipsis" and not column.no_wrap else column.overflow
