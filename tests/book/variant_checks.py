"""A class's private variant of a chapter's exercises, tried with the chapter's own checks.

`minillm exercises release --seed S --out DIR` writes the exercises with every check
drawing its worked examples from the class seed (`minillm.course.variants`). A chapter's
test class that mixes in `PrivateVariantChecks` then shows, per exercise:

- the private check still passes on the solution (the drawn examples are right answers);
- an answer *copied from the public edition* passes the public check and fails the private
  one. The copy is made by running the public check once with the solution and recording
  what each call returned; the copy returns those values in the same order, whatever it
  is asked: the public expected values, hard-coded. (The checks' Hypothesis examples are
  derandomized, so the public check asks the same questions in the same order again.)
"""

from __future__ import annotations

import copy
import pathlib

import pytest

from minillm.cli.main import main
from minillm.course.exercises import VARIANT_LINE
from minillm.course.notebook_io import read_notebook

from .conftest import ROOT
from .exercise_checks import ExceptionGroup, run_cell, wrong_in_place

SEED = "spring-term-7"  # any class seed: the test's own, not a class's secret


def copied_from_public(namespace: dict, name: str, check: str):
    """A maker of the answer that returns, call by call, what the solution returned in the
    public check: the public edition's expected values, typed in."""
    solution = namespace[name]
    results: list = []

    def recording(*args):
        result = solution(*args)
        results.append(copy.deepcopy(result))
        return result

    run_cell(check, wrong_in_place(namespace, name, recording))

    def make():
        calls = iter(range(len(results)))

        def copied(*args):
            return copy.deepcopy(results[next(calls, len(results) - 1)])

        return copied

    return make


class PrivateVariantChecks:
    """Mix into a chapter's `ExerciseChecks` subclass; `COPIED` names the exercises (plain
    functions of data) whose copied public answer is tried."""

    COPIED: list[str]

    def pytest_generate_tests(self, metafunc):
        if "copied" in metafunc.fixturenames:
            metafunc.parametrize("copied", self.COPIED)
        else:
            super().pytest_generate_tests(metafunc)

    @pytest.fixture(scope="class")
    @classmethod
    def private_checks(cls, solution, tmp_path_factory) -> dict[str, str]:
        """{exercise name: its check in the class's variant}, released by the command line."""
        out = tmp_path_factory.mktemp("private")
        argv = ["exercises", "release", "--seed", SEED, "--out", str(out)]
        folders = [f"--solutions={ROOT / 'solutions'}", f"--config={ROOT / '_config.yml'}"]
        assert main([*argv, *folders, f"--exercises={ROOT / 'exercises'}"]) == 0
        nb = read_notebook(out / pathlib.Path(cls.EXERCISE).name)
        seed_line = VARIANT_LINE.format(seed=SEED)
        # the public check is the private one without its seed line
        private = {
            c.source.replace(seed_line, ""): c.source for c in nb.cells if seed_line in c.source
        }
        _, checks = solution
        return {name: private[check] for name, check in checks.items()}

    def test_every_check_draws_a_worked_example_from_the_class_seed(self, private_checks):
        for name, check in private_checks.items():
            assert f"CLASS_SEED = {SEED!r}" in check, name
            assert "variant(" in check, f"{name}: no worked example drawn through variant"

    def test_private_check_passes_on_the_solution(self, solution, private_checks, name):
        namespace, _ = solution
        run_cell(private_checks[name], dict(namespace))

    def test_an_answer_copied_from_the_public_edition_fails_the_private_check(
        self, solution, private_checks, copied
    ):
        namespace, checks = solution
        make = copied_from_public(dict(namespace), copied, checks[copied])
        run_cell(checks[copied], wrong_in_place(namespace, copied, make()))  # the public check
        with pytest.raises((AssertionError, ExceptionGroup)):
            run_cell(private_checks[copied], wrong_in_place(namespace, copied, make()))
