"""Tables that fit the terminal: columns dropped by priority, user text never read as markup.

Every cell is a :class:`rich.text.Text`, so a sweep name, a parameter value or a failure
reason holding ``[bold]`` or ``[/x]`` prints as typed instead of raising ``MarkupError``. A
table wider than the console (80 columns when piped) leaves out its least important columns
first (after stacking the words of long headers over several lines) and says which in its
caption, or, for tables of few rows, shows each row as a paragraph of ``header value`` pairs;
the columns of priority 0 (a trial's ``#``) always stay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from rich import box
from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

__all__ = ["TableColumn", "cell", "fitted_table", "print_wide"]

Justify = Literal["left", "right", "center"]


def cell(value: object, style: str = "") -> Text:
    """A table cell showing ``value`` literally (no markup), optionally styled.

    Args:
        value: What to show; ``None`` is an empty cell.
        style: A rich style for the whole cell, e.g. ``"green"``.

    Returns:
        The cell.
    """
    return Text("" if value is None else str(value), style=style)


@dataclass
class TableColumn:
    """One column of a :func:`fitted_table`.

    Args:
        header: The column's header.
        priority: 0: always shown; otherwise the highest number is left out first when the
            table is wider than the console.
        justify: Alignment of the cells.
        wrap: Whether long cells may wrap over several lines rather than widen the table.
        cells: One cell per row.
    """

    header: str
    priority: int = 0
    justify: Justify = "left"
    wrap: bool = False
    cells: list[Text] = field(default_factory=list)


def _stacked(header: str) -> str:
    """A header over several lines: one word (or ``a/`` of ``a/b``) a line."""
    return header.replace("/", "/ ").replace(" ", "\n").replace("\n\n", "\n")


def _build(columns: Sequence[TableColumn], title: Text | None, stack: bool) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption_justify="left")
    for column in columns:
        header = Text(_stacked(column.header) if stack else column.header)
        table.add_column(header, justify=column.justify, no_wrap=not column.wrap,
                         overflow="fold" if column.wrap else "ellipsis")
    num_rows = max((len(c.cells) for c in columns), default=0)
    for row in range(num_rows):
        table.add_row(*(c.cells[row] if row < len(c.cells) else Text() for c in columns))
    return table


def _line_width(text: Text) -> int:
    return max((len(line) for line in text.plain.splitlines()), default=0)


def _word_width(text: Text) -> int:
    return max((len(word) for word in text.plain.split()), default=0)


def _needed_width(console: Console, table: Table, columns: Sequence[TableColumn]) -> int:
    """Columns the table needs: natural width of fixed columns, longest word of wrapping ones."""
    wide = console.options.update_width(10_000)
    width = Measurement.get(console, wide, table).maximum
    for column, shown in zip(columns, table.columns, strict=True):
        if column.wrap:
            header = shown.header if isinstance(shown.header, Text) else Text(str(shown.header))
            natural = max([_line_width(header), *(_line_width(c) for c in column.cells)])
            least = max([_line_width(header), *(_word_width(c) for c in column.cells)])
            width -= natural - least
    return width


def _stacked_rows(columns: Sequence[TableColumn], title: Text | None) -> Group:
    """Each row as a paragraph: its always-shown cells, then ``header value`` pairs that wrap."""
    num_rows = max((len(c.cells) for c in columns), default=0)
    parts: list[RenderableType] = [title] if title is not None else []
    for row in range(num_rows):
        cells = [(c, c.cells[row]) for c in columns if row < len(c.cells)]
        key = Text(" · ").join(
            Text.assemble((c.header, "bold"), " ", cell) for c, cell in cells if c.priority == 0)
        rest = [Text.assemble((c.header, "dim"), " ", cell) for c, cell in cells
                if c.priority > 0 and cell.plain]
        parts += [key, Padding(Columns(rest, padding=(0, 3)), (0, 0, 0, 2))]
    return Group(*parts)


def fitted_table(console: Console, columns: Sequence[TableColumn],
                 title: str | Text | None = None, stack_rows: bool = False,
                 wide: bool = False) -> RenderableType:
    """A table of ``columns`` that fits ``console``'s width, least important columns left out.

    Args:
        console: The console it will print on (its width decides).
        columns: The columns, in display order.
        title: The title above it (plain text is not read as markup); it wraps.
        stack_rows: Where columns would be left out, show every row as a paragraph of
            ``header value`` pairs instead (for tables of few rows and many columns).
        wide: Leave nothing out and wrap nothing, however wide the table
            (``status --wide``): print it with :func:`print_wide`.

    Returns:
        The table (when columns were left out, its caption names them), or the stacked rows.
    """
    heading = Text(title) if isinstance(title, str) else title
    kept = list(columns)
    dropped: list[str] = []
    table = _build(kept, heading, stack=False)
    if wide:
        return table
    if _needed_width(console, table, kept) > console.width:  # first stack the headers
        table = _build(kept, heading, stack=True)
    while _needed_width(console, table, kept) > console.width:
        droppable = [c for c in kept if c.priority > 0]
        if not droppable:
            break
        if stack_rows:
            return _stacked_rows(columns, heading)
        worst = max(droppable, key=lambda c: (c.priority, kept.index(c)))
        kept.remove(worst)
        dropped.append(worst.header)
        table = _build(kept, heading, stack=True)
    if dropped:
        table.caption = Text(f"not shown at {console.width} columns: {', '.join(dropped)}",
                             style="dim")
    return table


def print_wide(console: Console, renderable: RenderableType) -> None:
    """Print a table at its natural width, wider than the console if need be (never cropped)."""
    wide = console.options.update_width(10_000)
    width = max(console.width, Measurement.get(console, wide, renderable).maximum)
    Console(file=console.file, width=width, force_terminal=console.is_terminal,
            color_system=console.color_system, no_color=console.no_color,  # type: ignore[arg-type]
            ).print(renderable, crop=False)
