"""`Canvas`: boxes, arrows and labels on a grid of units, in the book's house style."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from minillm.lab.figures import FONT_SIZE, PAGE_WIDTH_IN, PALETTE


def color(kind: str) -> str:
    """A palette colour by meaning (`request`, `compute`, `memory`, ...) or a literal colour."""
    return PALETTE.get(kind, kind)


def _lighten(hex_color: str, amount: float) -> str:
    """`hex_color` mixed with white: 0 keeps it, 1 gives white."""
    if not hex_color.startswith("#") or len(hex_color) != 7:
        return hex_color
    rgb = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
    mixed = [round(c + (255 - c) * amount) for c in rgb]
    return "#" + "".join(f"{c:02x}" for c in mixed)


class Canvas:
    """A diagram `width` x `height` units; one unit is `PAGE_WIDTH_IN / width` inches at most.

    >>> c = Canvas(10, 4)
    >>> a = c.box(1, 1, 3, 2, "prefill", kind="compute")
    >>> b = c.box(6, 1, 3, 2, "decode", kind="compute")
    >>> c.arrow(a, b, "KV cache")
    """

    def __init__(self, width: float, height: float, inches: float | None = None):
        inches = inches or min(PAGE_WIDTH_IN, width * 0.8)
        self.width, self.height = width, height
        self.figure = Figure(figsize=(inches, inches * height / width))
        self.ax = self.figure.add_axes((0, 0, 1, 1))
        self.ax.set_xlim(0, width)
        self.ax.set_ylim(0, height)
        self.ax.set_aspect("equal")
        self.ax.axis("off")
        self.boxes: list[tuple[float, float, float, float, str]] = []

    def box(
        self,
        x: float,
        y: float,
        w: float,
        h: float,
        label: str = "",
        kind: str = "free",
        *,
        fill: float = 0.55,
        fontsize: float | None = None,
        rounded: bool = True,
        dashed: bool = False,
        bold: bool = False,
        text_color: str | None = None,
    ) -> tuple[float, float, float, float]:
        """A box with its lower left corner at (x, y), filled with `kind`'s colour lightened by
        `fill`; returns (x, y, w, h) for arrows."""
        edge = color(kind)
        style = "round,pad=0,rounding_size=0.15" if rounded else "square,pad=0"
        self.ax.add_patch(
            FancyBboxPatch(
                (x, y),
                w,
                h,
                boxstyle=style,
                facecolor=_lighten(edge, fill),
                edgecolor=edge,
                linewidth=1.2,
                linestyle="--" if dashed else "-",
            )
        )
        if label:
            self.ax.text(
                x + w / 2,
                y + h / 2,
                label,
                ha="center",
                va="center",
                fontsize=fontsize or FONT_SIZE,
                fontweight="bold" if bold else "normal",
                color=text_color or PALETTE["ink"],
            )
        self.boxes.append((x, y, w, h, label))
        return (x, y, w, h)

    def text(self, x: float, y: float, label: str, *, size: float | None = None, **kw) -> None:
        """Text centred on (x, y) unless `ha`/`va` say otherwise."""
        kw.setdefault("ha", "center")
        kw.setdefault("va", "center")
        kw.setdefault("color", PALETTE["ink"])
        self.ax.text(x, y, label, fontsize=size or FONT_SIZE, **kw)

    @staticmethod
    def _anchor(box, side: str) -> tuple[float, float]:
        x, y, w, h = box
        return {
            "left": (x, y + h / 2),
            "right": (x + w, y + h / 2),
            "top": (x + w / 2, y + h),
            "bottom": (x + w / 2, y),
            "center": (x + w / 2, y + h / 2),
        }[side]

    def arrow(
        self,
        start,
        end,
        label: str = "",
        *,
        sides: tuple[str, str] | None = None,
        kind: str = "ink",
        curve: float = 0.0,
        dashed: bool = False,
        label_offset: tuple[float, float] = (0.0, 0.25),
        fontsize: float | None = None,
        both: bool = False,
    ) -> None:
        """An arrow from `start` to `end`, each a point (x, y) or a box from `box`; between
        boxes it runs from the facing sides (or `sides`), bent by `curve`."""
        if len(start) == 4 and len(end) == 4:
            if sides is None:
                sx, sy = self._anchor(start, "center")
                ex, ey = self._anchor(end, "center")
                if abs(ex - sx) >= abs(ey - sy):
                    sides = ("right", "left") if ex > sx else ("left", "right")
                else:
                    sides = ("top", "bottom") if ey > sy else ("bottom", "top")
            start = self._anchor(start, sides[0])
            end = self._anchor(end, sides[1])
        elif len(start) == 4:
            start = self._anchor(start, (sides or ("right", ""))[0])
        elif len(end) == 4:
            end = self._anchor(end, (sides or ("", "left"))[1])
        self.ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                arrowstyle="<|-|>" if both else "-|>",
                mutation_scale=12,
                color=color(kind),
                linewidth=1.3,
                linestyle="--" if dashed else "-",
                connectionstyle=f"arc3,rad={curve}",
                shrinkA=2,
                shrinkB=2,
            )
        )
        if label:
            mx = (start[0] + end[0]) / 2 + label_offset[0]
            my = (start[1] + end[1]) / 2 + label_offset[1]
            self.text(mx, my, label, size=fontsize or FONT_SIZE - 1, color=PALETTE["muted"])

    def labels(self) -> list[str]:
        """The labels of the boxes drawn, in order (what a test reads back)."""
        return [b[4] for b in self.boxes if b[4]]
