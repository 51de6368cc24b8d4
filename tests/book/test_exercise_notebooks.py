"""The repository's exercises: current with their solutions, and graded as designed.

Every solution notebook runs clean in a kernel and carries the outputs a fresh run
produces; every exercise notebook fails at each graded cell (with the stub's
NotImplementedError) and nowhere else; every notebook starts with the bootstrap cell;
and `minillm grade`, with the released exercises as reference, gives each solution full
marks.
"""

from __future__ import annotations

import copy

import pytest

from minillm.course.bootstrap import is_bootstrap_cell, repository_url
from minillm.course.exercises import stale_exercises
from minillm.course.grading import grade_notebooks
from minillm.course.notebook_io import execute_notebook, graded_cells, read_notebook

from .conftest import ROOT

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
TIMEOUT_S = 120


def ids(paths):
    return [f"{p.parent.name}/{p.name}" for p in paths]


def test_there_are_exercises():
    assert SOLUTIONS, "solutions/ holds no notebooks"


def test_exercises_are_current_with_solutions():
    stale = stale_exercises(
        ROOT / "solutions", ROOT / "exercises", repository_url(ROOT / "_config.yml")
    )
    assert stale == [], "run `minillm exercises release`"


@pytest.mark.parametrize("path", SOLUTIONS + EXERCISES, ids=ids(SOLUTIONS + EXERCISES))
def test_the_first_code_cell_is_the_bootstrap(path):
    cells = read_notebook(path).cells
    first = next(cell for cell in cells if cell.cell_type == "code")
    assert is_bootstrap_cell(first, repository_url(ROOT / "_config.yml"))
    if path in SOLUTIONS:
        assert cells[0] is first
    else:  # an exercise page opens with its title, the bootstrap right below it
        assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# ")
        assert cells[1] is first


@pytest.mark.parametrize("path", EXERCISES, ids=ids(EXERCISES))
def test_checks_are_collapsed_in_the_book(path):
    graded = [c for c in read_notebook(path).cells if c.source.startswith("# GRADED")]
    assert graded and all("hide-input" in c.metadata.get("tags", []) for c in graded)


def code_cells(nb) -> set[int]:
    return {i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()}


@pytest.mark.parametrize("path", SOLUTIONS, ids=ids(SOLUTIONS))
def test_solution_runs_clean_and_stores_its_outputs(path):
    nb = read_notebook(path)
    stored = copy.deepcopy(nb)
    errors = execute_notebook(nb, path.parent, TIMEOUT_S)
    assert {i: e for i, e in errors.items() if e is not None} == {}
    assert set(errors) == code_cells(nb)
    assert graded_cells(nb)
    for i in code_cells(nb):
        fresh = (nb.cells[i].execution_count, nb.cells[i].outputs)
        assert (stored.cells[i].execution_count, stored.cells[i].outputs) == fresh, (
            f"cell {i}: stored outputs differ from a fresh run; run `minillm exercises execute`"
        )


@pytest.mark.parametrize("path", EXERCISES, ids=ids(EXERCISES))
def test_exercise_fails_exactly_at_its_graded_cells(path):
    nb = read_notebook(path)
    graded = graded_cells(nb)
    errors = execute_notebook(nb, path.parent, TIMEOUT_S)
    assert set(errors) == code_cells(nb), "every code cell runs"
    failed = {i: e for i, e in errors.items() if e is not None}
    assert set(failed) == set(graded)
    for i, error in failed.items():
        assert error.startswith("NotImplementedError"), f"cell {i} fails for another reason"


@pytest.mark.slow
def test_the_grader_gives_each_solution_full_marks():
    """Each solution, graded as a student's submission against the released exercises."""
    grades, problems = grade_notebooks(SOLUTIONS, ROOT / "exercises", TIMEOUT_S, jobs=2)
    assert problems == []
    for path, grade in zip(SOLUTIONS, grades, strict=True):
        assert grade.reference == str(ROOT / "exercises" / path.name)
        failed = {e.name: e.error for e in grade.exercises if not e.passed}
        assert failed == {}, path.name
        assert grade.points == grade.max_points == sum(graded_cells(read_notebook(path)).values())
