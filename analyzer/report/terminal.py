"""Terminal output that reads like git's or pip's: no line ends in spaces, and a wrapped line keeps its indent.
Shared by the summaries of a recording (report/text.py) and of a log (report/log_text.py)."""
from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.padding import Padding
from rich.segment import Segment
from rich.table import Table
from rich.text import Text


class Trimmed:
    """A renderable's lines without the spaces at their ends (tables pad every cell to its width): output to
    copy into an issue, like git's or pip's, has none."""

    def __init__(self, inner: RenderableType) -> None:
        self.inner = inner

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in console.render_lines(self.inner, options, pad=False, new_lines=False):
            segments = list(line)
            while segments and not segments[-1].control and not segments[-1].text.rstrip(" "):
                segments.pop()
            if segments and not segments[-1].control:
                last = segments[-1]
                segments[-1] = Segment(last.text.rstrip(" "), last.style)
            yield from segments
            yield Segment.line()


def indented(text: Text, indent: int, hang: int = 0) -> Padding:
    """`text` at `indent` columns, its wrapped lines at `indent + hang` (a numbered item's body under its text,
    not under its number)."""
    if not hang:
        return Padding(text, (0, 0, 0, indent))
    grid = Table.grid()
    grid.add_column(width=hang, no_wrap=True)
    grid.add_column()
    head, body = text[:hang], text[hang:]
    grid.add_row(head, body)
    return Padding(grid, (0, 0, 0, indent))
