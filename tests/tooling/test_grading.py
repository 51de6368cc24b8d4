"""`minillm grade` and grade_notebook: run notebooks, score the `# GRADED: N points` cells.

Each run starts a kernel (a few seconds), so the notebooks are graded once per module
and the tests read the results.
"""

from __future__ import annotations

import csv
import json
import pathlib

import nbformat
import pytest

from minillm.cli.main import main
from minillm.course.exercises import release
from minillm.course.grading import grade_notebook, graded_points, write_report

from .conftest import (
    GRADED_POINTS,
    REPO_URL,
    SOLUTION_CELLS,
    code,
    notebook,
    replace_source,
    write_notebook,
)

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def submissions(tmp_path_factory) -> pathlib.Path:
    """A folder of submissions: correct, the released stub, a wrong answer, a syntax error."""
    root = tmp_path_factory.mktemp("grading")
    solutions, folder = root / "solutions", root / "submissions"
    write_notebook(solutions / "correct.ipynb", notebook(SOLUTION_CELLS))
    release(solutions, folder, REPO_URL)
    (folder / "correct.ipynb").rename(folder / "stub.ipynb")
    write_notebook(folder / "correct.ipynb", notebook(SOLUTION_CELLS))
    wrong = notebook(SOLUTION_CELLS)
    replace_source(wrong, 4, "x * x", "2 * x")  # doubles instead of squaring
    write_notebook(folder / "wrong.ipynb", wrong)
    syntax = notebook(SOLUTION_CELLS)
    replace_source(syntax, 6, "len(xs)", "len(xs")
    write_notebook(folder / "syntax.ipynb", syntax)
    return folder


@pytest.fixture(scope="module")
def grades(submissions):
    names = ("correct", "stub", "wrong", "syntax")
    return {name: grade_notebook(submissions / f"{name}.ipynb", TIMEOUT_S) for name in names}


def scores(grade) -> dict[int, int]:
    return {cell.index: cell.points for cell in grade.cells}


def test_graded_points_reads_the_marker():
    assert graded_points("# GRADED: 2 points\nassert True") == 2
    assert graded_points("x = 1\n  # GRADED: 1 point") == 1
    assert graded_points("# GRADED: 10 points  ") == 10
    assert graded_points("assert True  # GRADED: 2 points") is None
    assert graded_points("# graded later") is None


def test_a_correct_answer_scores_full_points(grades):
    grade = grades["correct"]
    assert grade.error is None
    assert scores(grade) == GRADED_POINTS
    assert all(cell.passed and cell.error is None for cell in grade.cells)
    assert (grade.points, grade.max_points) == (6, 6)


def test_the_stub_scores_zero_failing_at_each_graded_cell(grades):
    grade = grades["stub"]
    assert grade.error is None
    assert [cell.index for cell in grade.cells] == [3, 5, 7]
    for cell in grade.cells:
        assert not cell.passed
        assert cell.error == "NotImplementedError: replace this line with your solution"
    assert (grade.points, grade.max_points) == (0, 6)


def test_a_wrong_answer_loses_exactly_its_cells_points(grades):
    grade = grades["wrong"]
    assert scores(grade) == {3: 2, 5: 0, 7: 3}
    assert grade.cells[1].error == "AssertionError"
    assert (grade.points, grade.max_points) == (5, 6)


def test_a_syntax_error_fails_only_what_depends_on_it(grades):
    grade = grades["syntax"]
    assert grade.error is None
    assert scores(grade) == {3: 2, 5: 1, 7: 0}
    assert grade.cells[2].error == "NameError: name 'mean' is not defined"


def test_unreadable_notebooks_are_reported_not_raised(tmp_path):
    (tmp_path / "garbage.ipynb").write_text("{not json", encoding="utf-8")
    (tmp_path / "list.ipynb").write_text("[1, 2]", encoding="utf-8")
    (tmp_path / "no_cells.ipynb").write_text(
        '{"nbformat": 4, "nbformat_minor": 5, "metadata": {}}', encoding="utf-8"
    )
    garbage = grade_notebook(tmp_path / "garbage.ipynb")
    assert garbage.error.startswith("not valid JSON: ")
    assert (garbage.cells, garbage.points, garbage.max_points) == ([], 0, 0)
    assert grade_notebook(tmp_path / "list.ipynb").error == (
        "not a Jupyter notebook (expected a JSON object with nbformat 4)"
    )
    assert grade_notebook(tmp_path / "no_cells.ipynb").error.startswith("not a valid notebook: ")


def test_a_dead_kernel_is_reported_with_the_points_at_stake(tmp_path):
    nb = notebook(
        [
            code("# GRADED: 1 point\nassert True"),
            code("import os\nos._exit(1)"),
            code("# GRADED: 2 points"),
        ]
    )
    grade = grade_notebook(write_notebook(tmp_path / "dies.ipynb", nb), TIMEOUT_S)
    assert grade.error == "did not run: DeadKernelError: Kernel died"
    assert (grade.points, grade.max_points) == (0, 3)
    assert all(cell.error == "not run" for cell in grade.cells)


def test_a_cell_past_the_timeout_fails_and_the_next_cells_still_run(tmp_path):
    nb = notebook(
        [
            code("# GRADED: 1 point\nimport time\ntime.sleep(60)"),
            code("# GRADED: 2 points\nassert 1 + 1 == 2"),
        ]
    )
    grade = grade_notebook(write_notebook(tmp_path / "slow.ipynb", nb), timeout_s=2)
    assert grade.error is None
    assert scores(grade) == {1: 0, 2: 2}
    assert grade.cells[0].error == "Timeout: the cell ran longer than 2 s and was interrupted"


def test_the_kernel_runs_in_the_notebook_folder(tmp_path):
    (tmp_path / "data.txt").write_text("42")
    nb = notebook([code("# GRADED: 1 point\nassert open('data.txt').read() == '42'")])
    grade = grade_notebook(write_notebook(tmp_path / "reads.ipynb", nb), TIMEOUT_S)
    assert (grade.points, grade.max_points) == (1, 1)


def test_json_report_holds_the_numbers(grades, tmp_path):
    report = tmp_path / "grades.json"
    write_report(list(grades.values()), report)
    data = json.loads(report.read_text())
    by_name = {pathlib.Path(nb["path"]).stem: nb for nb in data["notebooks"]}
    assert {name: (nb["points"], nb["max_points"]) for name, nb in by_name.items()} == {
        "correct": (6, 6),
        "stub": (0, 6),
        "wrong": (5, 6),
        "syntax": (3, 6),
    }
    assert by_name["wrong"]["cells"][1] == {
        "cell": 5,
        "points": 0,
        "max_points": 1,
        "passed": False,
        "error": "AssertionError",
    }


def test_csv_report_has_a_row_per_graded_cell_and_a_total(grades, tmp_path):
    report = tmp_path / "grades.csv"
    write_report([grades["wrong"]], report)
    with report.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["cell"], r["points"], r["max_points"], r["passed"]) for r in rows] == [
        ("3", "2", "2", "True"),
        ("5", "0", "1", "False"),
        ("7", "3", "3", "True"),
        ("total", "5", "6", ""),
    ]
    assert rows[1]["error"] == "AssertionError"
    assert {r["notebook"] for r in rows} == {str(grades["wrong"].path)}


def test_cli_grades_folders_reports_bad_paths_and_continues(submissions, tmp_path, capsys):
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "a_broken.ipynb").write_text("{not json", encoding="utf-8")
    write_notebook(folder / "student" / "b_correct.ipynb", notebook(SOLUTION_CELLS))
    (tmp_path / "notes.txt").write_text("hello")
    report = tmp_path / "grades.csv"
    missing = tmp_path / "missing.ipynb"

    status = main(
        ["grade", str(missing), str(folder), str(tmp_path / "notes.txt"), "--report", str(report)]
    )

    assert status == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"minillm grade: {missing}: no such file or folder",
        f"minillm grade: {tmp_path / 'notes.txt'}: not a notebook (expected an .ipynb file "
        "or a folder)",
    ]
    lines = out.splitlines()
    assert lines[0].split() == ["notebook", "cell", "points", "result"]
    broken, correct = str(folder / "a_broken.ipynb"), str(folder / "student" / "b_correct.ipynb")
    assert lines[1].split()[:4] == [broken, "total", "0/0", "could"]
    assert lines[-1].split() == [correct, "total", "6/6"]
    with report.open(newline="") as f:
        totals = [(r["notebook"], r["points"]) for r in csv.DictReader(f) if r["cell"] == "total"]
    assert totals == [(broken, "0"), (correct, "6")]


def test_cli_exit_status_is_0_when_everything_ran_whatever_the_score(submissions, capsys):
    assert main(["grade", str(submissions / "stub.ipynb"), "--timeout", "30"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[-2:] == ["total", "0/6"]


@pytest.mark.parametrize(
    "argv",
    [["grade", "x.ipynb", "--report", "grades.txt"], ["grade", "x.ipynb", "--timeout", "0"]],
)
def test_cli_rejects_bad_options_before_grading(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("minillm grade: ")


STUB = 'raise NotImplementedError("replace this line with your solution")'


def filled_in(released: pathlib.Path, answers: dict[int, str]) -> nbformat.NotebookNode:
    """The released notebook with the stub of cell i replaced by `answers[i]`."""
    nb = nbformat.read(released, as_version=4)
    for index, answer in answers.items():
        replace_source(nb, index, STUB, answer)
    return nb


@pytest.fixture(scope="module")
def tampered(tmp_path_factory):
    """The released exercise as reference, and submissions that edit the checks."""
    root = tmp_path_factory.mktemp("tampered")
    write_notebook(root / "solutions" / "ex.ipynb", notebook(SOLUTION_CELLS))
    release(root / "solutions", root / "reference", REPO_URL)
    released = root / "reference" / "ex.ipynb"
    right = {2: "return 2 * x", 6: "return sum(xs) / len(xs)"}
    # square is wrong, and its check is weakened so that the wrong answer passes
    weakened = filled_in(released, {**right, 4: "return 2 * x"})
    weakened.cells[5].source = "# GRADED: 1 point\nassert True"
    # a check the student wrote for themselves, worth a lot
    weakened.cells.append(code("# GRADED: 50 points\nassert True"))
    write_notebook(root / "class" / "weakened" / "ex.ipynb", weakened)
    # the check of mean is deleted; the other answers are right
    deleted = filled_in(released, {**right, 4: "return x * x"})
    del deleted.cells[7]
    write_notebook(root / "class" / "deleted" / "ex.ipynb", deleted)
    # a tool gave every cell a new id; answers right, square's check weakened again
    renamed = filled_in(released, {**right, 4: "return x + x"})
    renamed.cells[5].source = "# GRADED: 1 point\nassert True"
    for i, cell in enumerate(renamed.cells):
        cell.id = f"other-{i}"
    write_notebook(root / "class" / "renamed" / "ex.ipynb", renamed)
    # new ids and one graded cell fewer: nothing to match by
    unmatched = nbformat.from_dict(dict(renamed))
    del unmatched.cells[7]
    write_notebook(root / "class" / "unmatched" / "ex.ipynb", unmatched)
    return root


def test_without_a_reference_edited_checks_count(tampered):
    grade = grade_notebook(tampered / "class" / "weakened" / "ex.ipynb", TIMEOUT_S)
    assert (grade.points, grade.max_points) == (56, 56)


def test_the_reference_restores_edited_checks_and_ignores_added_ones(tampered):
    grade = grade_notebook(
        tampered / "class" / "weakened" / "ex.ipynb", TIMEOUT_S, tampered / "reference"
    )
    assert grade.error is None
    assert scores(grade) == {3: 2, 5: 0, 7: 3}
    assert grade.cells[1].error == "AssertionError"
    assert (grade.points, grade.max_points) == (5, 6)


def test_a_deleted_check_scores_zero_with_the_reference(tampered):
    grade = grade_notebook(
        tampered / "class" / "deleted" / "ex.ipynb", TIMEOUT_S, tampered / "reference" / "ex.ipynb"
    )
    assert grade.error is None
    assert scores(grade) == {3: 2, 5: 1, 7: 0}
    assert grade.cells[2].error == "missing from the submission"


def test_graded_cells_are_matched_in_order_when_no_id_matches(tampered):
    grade = grade_notebook(
        tampered / "class" / "renamed" / "ex.ipynb", TIMEOUT_S, tampered / "reference"
    )
    assert grade.error is None
    assert scores(grade) == {3: 2, 5: 0, 7: 3}


def test_unmatchable_graded_cells_fail_with_a_reason(tampered):
    grade = grade_notebook(
        tampered / "class" / "unmatched" / "ex.ipynb", TIMEOUT_S, tampered / "reference"
    )
    assert grade.error == (
        "cannot grade: cell ids differ from the reference's and the submission has 2 graded "
        "cells where the reference has 3"
    )
    assert (grade.points, grade.max_points) == (0, 6)
    assert [cell.index for cell in grade.cells] == [3, 5, 7]


def test_a_missing_reference_is_reported_per_submission(tampered, tmp_path):
    grade = grade_notebook(tampered / "class" / "deleted" / "ex.ipynb", TIMEOUT_S, tmp_path)
    assert grade.error == f"reference {tmp_path / 'ex.ipynb'}: cannot read: " + (
        f"[Errno 2] No such file or directory: '{tmp_path / 'ex.ipynb'}'"
    )
    assert grade.cells == []


def test_cli_grades_against_a_reference_folder(tampered, tmp_path, capsys):
    report = tmp_path / "grades.json"
    submission = tampered / "class" / "weakened" / "ex.ipynb"
    argv = ["grade", str(submission), "--reference", str(tampered / "reference")]
    assert main([*argv, "--report", str(report)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split() == [str(submission), "total", "5/6"]
    assert json.loads(report.read_text())["notebooks"][0]["points"] == 5
    assert main(["grade", str(submission), "--reference", str(tmp_path / "nope")]) == 2
    assert "--reference" in capsys.readouterr().err


def test_cli_says_where_cut_messages_are_whole(tmp_path, capsys):
    long_message = "the answer is " + "very " * 40 + "wrong"
    cells = [code(f"# GRADED: 1 points\nassert False, {long_message!r}")]
    path = write_notebook(tmp_path / "long.ipynb", notebook(cells, bootstrap=False))
    assert main(["grade", str(path), "--timeout", "30"]) == 0
    out, err = capsys.readouterr()
    (row,) = [line for line in out.splitlines() if "failed:" in line]
    assert row.endswith("...") and long_message not in row
    assert "--report FILE.json keeps them whole" in err
    report = tmp_path / "grades.json"
    assert main(["grade", str(path), "--timeout", "30", "--report", str(report)]) == 0
    assert long_message in report.read_text()
    assert capsys.readouterr().err == ""
