"""What both pages of chapter 10 (serving systems and design) start from.

The chapter is two pages (`book/10_systems.md`, `book/10_systems_operations.md`), and
Jupyter Book runs each in a fresh kernel. The first page quotes the exercises' points in
its front matter and the second describes the exercises, so both count them with
`exercise_points`; `FORMULA_EXERCISES` are the exercises whose checks apply a formula the
chapter states (at most a third of the points), the rest build a mechanism or decide from
computed data. `RESULTS` is the folder of the recorded benchmark runs the first page
reads (present in a clone of the repository).
"""

from __future__ import annotations

import pathlib

from minillm.lab.exercise_count import exercise_points  # noqa: F401  (the pages' name)

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# exercise numbers (1-based, one graded cell each) that apply a formula the chapter states:
# replicas for a load, cost per million tokens, the fleet's cost per million
FORMULA_EXERCISES = (5, 6, 7)


def formula_points(points: list[int]) -> int:
    """The points of `FORMULA_EXERCISES` in a chapter's list of graded points."""
    return sum(points[n - 1] for n in FORMULA_EXERCISES)
