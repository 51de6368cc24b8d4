"""A pytest hook that names each graded cell of a notebook "Exercise N" under nbval.

nbval names every code cell "Cell <n>", counting code cells; the notebook's headings,
its checks' messages and `minillm grade` say "Exercise N", where N counts graded cells.
`exercises/conftest.py` (written by `minillm exercises release`) imports this hook, so
that `pytest --nbval-lax exercises/chNN_*.ipynb` reports a failure as
`exercises/chNN_*.ipynb::Exercise 3` rather than `::Cell 12`.
"""

from __future__ import annotations

from minillm.course.notebook_io import graded_points


def _exercise_numbers(nb) -> dict[int, int]:
    """{code cell number (nbval's count): exercise number} for the graded cells."""
    numbers, code_cell, exercise = {}, 0, 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if graded_points(cell.source) is not None:
            exercise += 1
            numbers[code_cell] = exercise
        code_cell += 1
    return numbers


def pytest_collection_modifyitems(session, config, items) -> None:
    numbers_of: dict[int, dict[int, int]] = {}
    for item in items:
        parent, cell_num = getattr(item, "parent", None), getattr(item, "cell_num", None)
        nb = getattr(parent, "nb", None)
        if nb is None or cell_num is None:
            continue  # not an nbval cell
        numbers = numbers_of.setdefault(id(nb), _exercise_numbers(nb))
        if cell_num not in numbers:
            continue
        label = f"Exercise {numbers[cell_num]}"
        item.name = label
        if hasattr(item, "_id") and hasattr(parent, "id"):  # pytest >= 9: structured node ids
            item._id = parent.id.child(label)
        else:
            item._nodeid = f"{parent.nodeid}::{label}"
        location = f"{parent.nodeid}::{label}"
        item.reportinfo = lambda location=location, path=item.path: (path, 0, location)
        repr_failure = item.repr_failure
        item.repr_failure = lambda excinfo, f=repr_failure, n=cell_num, label=label: f(
            excinfo
        ).replace(f"Cell {n}: ", f"{label}: ", 1)
