"""What both pages of chapter 10 (serving systems and design) start from.

The chapter is two pages (`book/10_systems.md`, `book/10_systems_operations.md`), and
Jupyter Book runs each in a fresh kernel. The first page quotes the exercises' points in
its front matter and the second describes the exercises, so both count them with
`exercise_points`. `RESULTS` is the folder of the recorded benchmark runs the first page
reads (present in a clone of the repository).
"""

from __future__ import annotations

import pathlib

from minillm.lab.exercise_count import exercise_points  # noqa: F401  (the pages' name)

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
