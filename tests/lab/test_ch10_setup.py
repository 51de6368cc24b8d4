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


def test_results_is_the_folder_of_the_recorded_runs_the_first_page_reads():
    assert ch10_setup.RESULTS.name == "results"
    assert (ch10_setup.RESULTS / "routing_cpu.json").exists()
    assert (ch10_setup.RESULTS / "overlap_cpu.json").exists()
