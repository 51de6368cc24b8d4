"""Run an exercise notebook's check cells in this process, to test the checks themselves.

The tests of each chapter's exercises (test_chNN_*.py) run the notebook's non-graded
cells here, without a kernel, and keep each graded cell's source. Then each graded cell
runs with the solution (it must pass), with the released stub (NotImplementedError), and
with each plausible wrong answer put in the solution's place (AssertionError, or several
in hypothesis's ExceptionGroup).
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import pathlib
import re
from collections.abc import Callable, Iterable

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from minillm.course.notebook_io import graded_cells, read_notebook

# hypothesis reports several distinct failures as one; Python 3.10 has it from a backport
ExceptionGroup = (
    getattr(builtins, "ExceptionGroup", None)
    or importlib.import_module("exceptiongroup").ExceptionGroup
)
DEFINITION = re.compile(r"^(?:async def|def|class) (\w+)\b", re.MULTILINE)


def run_cell(source: str, namespace: dict) -> None:
    """Execute a notebook cell's source in `namespace`, IPython syntax (%pip, !) included.

    The bootstrap cell's %pip line becomes get_ipython().run_line_magic(...) in a branch
    that does not run here, since minillm imports.
    """
    exec(compile(TransformerManager().transform_cell(source), "<cell>", "exec"), namespace)


def exercise_namespace(path: pathlib.Path, names: Iterable[str]) -> tuple[dict, dict[str, str]]:
    """Run the non-graded cells of a notebook; returns its namespace and {name: check}.

    The check of a function or class in `names` is the first graded cell after the cell
    that defines it at top level.
    """
    names = set(names)
    nb = read_notebook(path)
    graded = sorted(graded_cells(nb))
    namespace: dict = {}
    checks: dict[str, str] = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or i in graded:
            continue
        run_cell(cell.source, namespace)
        for name in DEFINITION.findall(cell.source):
            if name in names:
                checks[name] = nb.cells[next(j for j in graded if j > i)].source
    return namespace, checks


@dataclasses.dataclass(frozen=True)
class FromNamespace:
    """A wrong answer built from the notebook's namespace (it calls the notebook's objects)."""

    factory: Callable[[dict], object]


def wrong_in_place(namespace: dict, name: str, wrong: object) -> dict:
    """A copy of `namespace` in which `name` is the wrong answer."""
    namespace = dict(namespace)
    namespace[name] = wrong.factory(dict(namespace)) if isinstance(wrong, FromNamespace) else wrong
    return namespace


class ExerciseChecks:
    """The tests of one exercise notebook's checks; a chapter's test module subclasses it.

    A subclass named Test... sets SOLUTION and EXERCISE (the two notebooks), POINTS (the
    points of each graded cell, in order) and WRONG_ANSWERS ({function or class name:
    {label: wrong answer, or FromNamespace(factory)}}).
    """

    SOLUTION: pathlib.Path
    EXERCISE: pathlib.Path
    POINTS: list[int]
    WRONG_ANSWERS: dict[str, dict[str, object]]

    def pytest_generate_tests(self, metafunc):
        if "label" in metafunc.fixturenames:
            cases = [(name, label) for name, wrong in self.WRONG_ANSWERS.items() for label in wrong]
            metafunc.parametrize("name, label", cases, ids=[f"{n}-{w}" for n, w in cases])
        elif "name" in metafunc.fixturenames:
            metafunc.parametrize("name", sorted(self.WRONG_ANSWERS))

    @pytest.fixture(scope="class")
    @classmethod
    def solution(cls) -> tuple[dict, dict[str, str]]:
        return exercise_namespace(cls.SOLUTION, cls.WRONG_ANSWERS)

    @pytest.fixture(scope="class")
    @classmethod
    def exercise(cls) -> tuple[dict, dict[str, str]]:
        return exercise_namespace(cls.EXERCISE, cls.WRONG_ANSWERS)

    def test_graded_cells_and_points(self):
        assert list(graded_cells(read_notebook(self.SOLUTION)).values()) == self.POINTS

    def test_each_exercise_has_its_check(self, solution):
        _, checks = solution
        assert sorted(checks) == sorted(self.WRONG_ANSWERS)

    def test_check_passes_on_the_solution(self, solution, name):
        namespace, checks = solution
        run_cell(checks[name], dict(namespace))

    def test_check_fails_on_the_stub(self, exercise, name):
        namespace, checks = exercise
        with pytest.raises(NotImplementedError):
            run_cell(checks[name], dict(namespace))

    def test_check_rejects_a_plausible_wrong_answer(self, solution, name, label):
        namespace, checks = solution
        wrong = self.WRONG_ANSWERS[name][label]
        with pytest.raises((AssertionError, ExceptionGroup)) as failure:
            run_cell(checks[name], wrong_in_place(namespace, name, wrong))
        if isinstance(failure.value, ExceptionGroup):
            assert failure.value.subgroup(AssertionError) is not None
            assert failure.value.split(AssertionError)[1] is None, "only assertions may fail"
