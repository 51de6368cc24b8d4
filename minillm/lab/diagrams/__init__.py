"""The book's diagrams: mechanisms drawn with matplotlib in the house style.

A diagram is a `Canvas`, a figure whose axes are a plain grid of units (no ticks), on
which boxes, arrows and labels are placed. Where a diagram shows the engine's state (a
block pool, a radix tree, a schedule) it is drawn from a real object of the engine, so the
picture is what the code does. Each chapter's diagrams live in their own module here.
"""

from minillm.lab.diagrams.canvas import Canvas, color

__all__ = ["Canvas", "color"]
