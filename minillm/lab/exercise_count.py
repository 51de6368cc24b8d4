"""The graded points of a chapter's exercise notebook, for the pages that quote them.

Every chapter page states its exercises' points in its "Time" line or its Exercises
section; this is the one function they count them with (through their chNN_setup module).
"""

from __future__ import annotations

import pathlib


def exercise_points(path: str | pathlib.Path) -> list[int] | None:
    """The points of each graded cell of the exercise notebook at `path`, in order.

    None when the notebook is not there (the book's pages read `../exercises/`, present in a
    clone of the repository, not in a Colab copy).
    """
    path = pathlib.Path(path)
    if not path.exists():
        return None
    # imported here: validating notebooks pulls in jsonschema, seconds a page need not pay
    from minillm.course.notebook_io import graded_points, read_notebook

    cells = [c for c in read_notebook(path).cells if c.cell_type == "code"]
    return [p for p in (graded_points(c.source) for c in cells) if p is not None]
