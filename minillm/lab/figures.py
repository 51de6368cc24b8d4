"""The book's house style for figures and tables, set once here.

Every chapter calls `use_house_style()` in its (hidden) setup cell: figures come out as
SVG, so they stay sharp on any screen, with one palette, one font size and light axes.
Computed tables go through `table`, which every page shares: a styled, scrollable HTML
table whose numbers line up on the right.

The colours have a meaning that holds across the book:

- `request` for requests, prompts and tokens a user sent;
- `compute` for work on the GPU's arithmetic units (a forward pass, a kernel, a GEMM);
- `memory` for bytes at rest: weights, the KV cache, a block of the pool;
- `free` for what is empty or waiting (free blocks, idle time, a queue);
- `host` for the CPU side (the scheduler, the tokenizer, a launch);
- `accent` for the one thing a figure asks you to look at.
"""

from __future__ import annotations

import html
import numbers
from collections.abc import Sequence
from typing import Any

PALETTE = {
    "request": "#4C72B0",
    "compute": "#DD8452",
    "memory": "#55A868",
    "free": "#D9D9D9",
    "host": "#8172B3",
    "accent": "#C44E52",
    "ink": "#222222",
    "muted": "#6F6F6F",
}
# the series colours of plots, in order (matplotlib's cycle, the palette's first)
SERIES = [PALETTE[k] for k in ("request", "compute", "memory", "host", "accent")] + [
    "#937860",
    "#DA8BC3",
    "#8C8C8C",
    "#CCB974",
    "#64B5CD",
]

FONT_SIZE = 11
# the page's text column is about 780 CSS pixels wide: a figure this wide is shown at its size
PAGE_WIDTH_IN = 7.8

HOUSE_RC = {
    "font.size": FONT_SIZE,
    "axes.titlesize": FONT_SIZE + 1,
    "axes.labelsize": FONT_SIZE,
    "xtick.labelsize": FONT_SIZE - 1,
    "ytick.labelsize": FONT_SIZE - 1,
    "legend.fontsize": FONT_SIZE - 1,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.edgecolor": PALETTE["muted"],
    "axes.labelcolor": PALETTE["ink"],
    "text.color": PALETTE["ink"],
    "figure.figsize": (PAGE_WIDTH_IN * 0.75, PAGE_WIDTH_IN * 0.45),
    "figure.dpi": 100,
    "savefig.bbox": "tight",
    "svg.fonttype": "path",
    "svg.hashsalt": "minillm",  # the same SVG for the same figure, build after build
}


def use_house_style(svg: bool = True) -> None:
    """Set the book's matplotlib style; with `svg`, notebooks show figures as SVG."""
    import matplotlib as mpl
    from cycler import cycler

    mpl.rcParams.update(HOUSE_RC)
    mpl.rcParams["axes.prop_cycle"] = cycler(color=SERIES)
    if svg:
        try:
            from matplotlib_inline.backend_inline import set_matplotlib_formats
        except ImportError:  # outside Jupyter: nothing shows figures inline anyway
            return
        set_matplotlib_formats("svg")


def _breakable(text: str) -> str:
    """Escaped text that may wrap after a path's `/` or a name's `_` (an HTML `<wbr>`), so a
    column of file paths or option names narrows to fit the page instead of hiding columns."""
    escaped = html.escape(text)
    return escaped.replace("/", "/<wbr>").replace("_", "_<wbr>")


def _cell(value: Any) -> tuple[str, bool]:
    """A value as table-cell HTML, and whether it is a number (aligned right)."""
    if isinstance(value, RawHTML):
        return value.text, False
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        text = str(value)
        stripped = text.replace(",", "").replace("%", "").replace("×", "").strip()
        try:
            float(stripped)
            numeric = True
        except ValueError:
            numeric = False
        return _breakable(text), numeric
    return html.escape(f"{value:,}" if isinstance(value, int) else f"{value}"), True


class RawHTML:
    """A table cell given as HTML (a `<code>` span, a link), not escaped."""

    def __init__(self, text: str):
        self.text = text


class Table:
    """A computed table: HTML in the book and in Jupyter, and plain text elsewhere."""

    def __init__(self, header: Sequence[str], rows: Sequence[Sequence[Any]]):
        self.header = [str(h) for h in header]
        self.rows = [list(row) for row in rows]
        for row in self.rows:
            if len(row) != len(self.header):
                raise ValueError(
                    f"a row of {len(row)} cells under a header of {len(self.header)}: {row}"
                )

    def _repr_html_(self) -> str:
        cells = [[_cell(v) for v in row] for row in self.rows]
        # a column is numeric when every cell of it is
        numeric = [all(row[i][1] for row in cells) for i in range(len(self.header))]
        align = ['class="text-right"' if n else "" for n in numeric]
        head = "".join(
            f"<th {a}>{_breakable(h)}</th>" for h, a in zip(self.header, align, strict=True)
        )
        body = "".join(
            "<tr>"
            + "".join(f"<td {a}>{c[0]}</td>" for c, a in zip(row, align, strict=True))
            + "</tr>"
            for row in cells
        )
        return (
            '<div class="pst-scrollable-table-container">'
            f'<table class="table minillm-table"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>"
        )

    def __repr__(self) -> str:
        widths = [
            max(len(str(x)) for x in [h] + [row[i] for row in self.rows])
            for i, h in enumerate(self.header)
        ]

        def line(values):
            return "  ".join(str(v).ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

        return "\n".join([line(self.header)] + [line(row) for row in self.rows])


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """A computed table for a page: `display(table(["a", "b"], [[1, 2]]))`.

    Cells are escaped text unless given as `RawHTML`; numeric columns align right.
    """
    return Table(header, rows)


def plain_log_ticks(axis) -> None:
    """Label a log-scale matplotlib axis (`ax.yaxis`, `ax.xaxis`) with plain numbers at 1, 2
    and 5 times each power of ten and leave the minor ticks unlabelled: a range of less than
    a decade still shows values, and none is printed as "6×10⁰"."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def code(text: str) -> RawHTML:
    """A table cell shown as code, e.g. a flag name or a string with its quotes."""
    return RawHTML(f"<code>{_breakable(text)}</code>")


__all__ = [
    "PALETTE",
    "SERIES",
    "PAGE_WIDTH_IN",
    "RawHTML",
    "Table",
    "code",
    "plain_log_ticks",
    "table",
    "use_house_style",
]
