"""Every solution notebook scores full marks when `minillm grade` grades it against the
released exercises, with the checks in their own process: what the checks of a chapter use
(threads, coroutines, forked ranks, a live server) must work across the grader's channel,
or the check must say that it runs in the student's process (the `student-process` tag)."""

from __future__ import annotations

import pathlib

import pytest

from minillm.course.grading import grade_notebooks

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("ch*.ipynb"))


@pytest.mark.slow
def test_every_solution_scores_full_marks():
    assert len(SOLUTIONS) >= 11, "the solution notebooks are missing"
    grades, problems = grade_notebooks(SOLUTIONS, reference=ROOT / "exercises", jobs=2)
    assert problems == []
    assert all(grade.error is None for grade in grades), [g.error for g in grades]
    failed = {
        pathlib.Path(grade.path).name: [
            (e.number, e.name, e.error) for e in grade.exercises if not e.passed
        ]
        for grade in grades
    }
    assert {name: exercises for name, exercises in failed.items() if exercises} == {}
    assert [grade.points for grade in grades] == [grade.max_points for grade in grades]
