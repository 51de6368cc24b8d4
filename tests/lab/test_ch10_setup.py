"""The shared setup of chapter 10's two pages reads the points and finds the recorded runs."""

from __future__ import annotations

import json

from minillm.lab import ch10_setup


def test_exercise_points_read_the_graded_markers_in_order(tmp_path):
    def cell(kind, source):
        extra = {"outputs": [], "execution_count": None} if kind == "code" else {}
        return {
            "cell_type": kind,
            "id": f"c{len(source)}",
            "metadata": {},
            "source": source,
            **extra,
        }

    cells = [
        cell("code", "x = 1"),
        cell("code", "# GRADED: 3 points\nassert x == 1"),
        cell("markdown", "# GRADED: 5 points (prose, not a check)"),
        cell("code", "# GRADED: 2 points\nassert True"),
    ]
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "ex.ipynb"
    path.write_text(json.dumps(nb))
    assert ch10_setup.exercise_points(path) == [3, 2]
    assert ch10_setup.exercise_points(tmp_path / "missing.ipynb") is None


def test_the_chapter_exercises_are_worth_the_points_the_checks_grade():
    from tests.book.test_ch10_systems import TestChecks

    points = ch10_setup.exercise_points(TestChecks.EXERCISE)
    assert points == TestChecks.POINTS
    assert len(points) == 14 and sum(points) == 37


def test_formula_points_are_at_most_a_third_of_the_chapters():
    from tests.book.test_ch10_systems import TestChecks

    assert ch10_setup.formula_points([1, 2, 3, 4, 5, 6, 7, 8]) == 5 + 6 + 7
    points = TestChecks.POINTS
    assert ch10_setup.formula_points(points) == 6
    assert 3 * ch10_setup.formula_points(points) <= sum(points)


def test_the_page_lists_the_exercises_and_names_the_formula_ones():
    page = (ch10_setup.RESULTS.parents[1] / "book" / "10_systems_operations.md").read_text()
    exercises = " ".join(
        page[page.index("## Exercises") : page.index("(ch10-references)=")].split()
    )
    assert "formula_points" in exercises and "overlap scheduling" in exercises
    assert "five:" not in exercises and "six:" in exercises


def test_results_is_the_folder_of_the_recorded_runs_the_first_page_reads():
    assert ch10_setup.RESULTS.name == "results"
    assert (ch10_setup.RESULTS / "routing_cpu.json").exists()
    assert (ch10_setup.RESULTS / "overlap_cpu.json").exists()
