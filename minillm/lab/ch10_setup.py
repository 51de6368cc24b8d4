"""What both pages of chapter 10 (serving systems and design) start from.

The chapter is two pages (`book/10_systems.md`, `book/10_systems_operations.md`), and
Jupyter Book runs each in a fresh kernel. The first page quotes the exercises' points in
its front matter and the second describes the exercises, so both count them with
`exercise_points`. `RESULTS` is the folder of the recorded benchmark runs the first page
reads (present in a clone of the repository).
"""

from __future__ import annotations

import pathlib

from minillm.course.notebook_io import graded_points, read_notebook

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def exercise_points(path: str | pathlib.Path) -> list[int] | None:
    """The points of each graded cell of the exercise notebook at `path`, in order.

    None when the notebook is not there (a page opened outside a clone of the repository).
    """
    path = pathlib.Path(path)
    if not path.exists():
        return None
    cells = read_notebook(path).cells
    sources = [cell.source for cell in cells if cell.cell_type == "code"]
    return [points for source in sources if (points := graded_points(source)) is not None]
