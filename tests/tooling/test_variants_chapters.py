"""A class's private release of the chapters whose checks draw their worked examples
through `variant` grades with other values than the public edition.

The cheat is the one a public worked example invites: an answer that returns the value
the public check expects for its worked example (the first call the check makes). On
each check that draws its worked example through `variant`, it scores nothing on a
class's private release, where the worked example's input is drawn
from the class seed; the solutions score full marks there.
"""

from __future__ import annotations

import pathlib
import shutil

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from minillm.course.bootstrap import repository_url
from minillm.course.exercise_model import parse_exercises
from minillm.course.exercises import release_variant
from minillm.course.grading import grade_notebooks

from .conftest import write_notebook

ROOT = pathlib.Path(__file__).resolve().parents[2]
# chapter: how many of its checks draw a worked example through variant
CHAPTERS = {"ch00_conventions": 5, "ch02_roofline": 1, "ch04_scheduling": 1, "ch05_kernels": 1}


def run_cell(source: str, namespace: dict) -> None:
    """A notebook cell's source, IPython syntax (the bootstrap's %pip) included."""
    exec(compile(TransformerManager().transform_cell(source), "<cell>", "exec"), namespace)


def recorded_answers(chapter: str) -> dict[str, list]:
    """{function: [result, ...]} of every call the public checks that draw through variant
    make of the solution."""
    nb = nbformat.read(ROOT / "solutions" / f"{chapter}.ipynb", as_version=4)
    exercises = parse_exercises(nb)
    functions = {
        name for e in exercises.exercises if "variant(" in e.check_source for name in e.functions
    }
    checks = {e.check_cell for e in exercises.exercises}
    varied = {e.check_cell for e in exercises.exercises if "variant(" in e.check_source}
    namespace: dict = {}
    tables: dict[str, list] = {name: [] for name in functions}

    def recording(name, fn):
        def call(*args):
            result = fn(*args)
            tables[name].append(result)
            return result

        return call

    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if i in checks and i not in varied:
            continue  # only the checks that draw through variant are asked
        if i in checks:
            run_cell(
                cell.source,
                {
                    **namespace,
                    **{n: recording(n, namespace[n]) for n in functions if n in namespace},
                },
            )
        else:
            run_cell(cell.source, namespace)
    return tables


def hard_coded_notebook(chapter: str, tables: dict[str, list]) -> nbformat.NotebookNode:
    """The released notebook answered with the public worked examples' expected values."""
    nb = nbformat.read(ROOT / "exercises" / f"{chapter}.ipynb", as_version=4)
    exercises = parse_exercises(nbformat.read(ROOT / "solutions" / f"{chapter}.ipynb", 4))
    for exercise in exercises.exercises:
        if "variant(" not in exercise.check_source:
            continue  # left unanswered
        [answer_id] = exercise.answer_ids
        [cell] = [c for c in nb.cells if c.get("id") == answer_id]
        cell.source = "\n\n".join(
            # the worked example comes first
            f"def {name}(*args):\n    return {tables[name][0]!r}\n"
            for name in exercise.functions
        )
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_private_release_rejects_the_public_values_and_accepts_the_solution(tmp_path, chapter):
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    shutil.copy(ROOT / "solutions" / f"{chapter}.ipynb", solutions)
    release_variant(
        solutions, tmp_path / "private", repository_url(ROOT / "_config.yml"), "fall-27"
    )
    private = tmp_path / "private" / f"{chapter}.ipynb"
    checks = parse_exercises(nbformat.read(private, as_version=4)).exercises
    varied = [e.name for e in checks if "variant(" in e.check_source]
    assert len(varied) == CHAPTERS[chapter]
    hard_coded = write_notebook(
        tmp_path / "hard_coded" / f"{chapter}.ipynb",
        hard_coded_notebook(chapter, recorded_answers(chapter)),
    )
    solution = ROOT / "solutions" / f"{chapter}.ipynb"

    [private_hard_coded, private_solution], problems = grade_notebooks(
        [hard_coded, solution], reference=private, jobs=2
    )
    assert problems == []
    assert private_solution.points == private_solution.max_points, [
        (e.name, e.error) for e in private_solution.exercises if not e.passed
    ]
    assert [e.name for e in private_hard_coded.exercises if e.name in varied and e.passed] == []
