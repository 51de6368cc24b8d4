"""`minillm grade`: each exercise's check run on the student's definitions, in a process of
its own, against a reference.

Grading starts a sandbox process per reference (a fraction of a second for these small
fixtures), so the notebooks of a module are graded together once and the tests read the
results.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import re

import nbformat
import pytest

from minillm.cli.main import main
from minillm.course.grading import (
    ExerciseGrade,
    NotebookGrade,
    format_summary,
    grade_notebook,
    grade_notebooks,
    graded_points,
    match_reference,
    read_notebook,
    write_report,
)
from minillm.course.sandbox import landlock_abi

from .conftest import (
    REPO_URL,
    RIGHT,
    SOLUTION_CELLS,
    code,
    filled,
    md,
    notebook,
    released_fixture,
    write_notebook,
)

TIMEOUT_S = 60
needs_landlock = pytest.mark.skipif(
    landlock_abi() < 6, reason="needs Linux Landlock (ABI 6) to confine file access and signals"
)


def scores(grade) -> dict[str, int]:
    return {e.name: e.points for e in grade.exercises}


def by_name(grade, name):
    [exercise] = [e for e in grade.exercises if e.name == name]
    return exercise


def test_graded_points_reads_the_marker():
    assert graded_points("# GRADED: 2 points\nassert True") == 2
    assert graded_points("x = 1\n  # GRADED: 1 point") == 1
    assert graded_points("# GRADED: 10 points  ") == 10
    assert graded_points("assert True  # GRADED: 2 points") is None
    assert graded_points("# graded later") is None


DEAF_LOOP = """import time
while True:
    try:
        time.sleep(0.2)
    except KeyboardInterrupt:
        pass"""

SELF_GRADED = {
    "correct": RIGHT,
    "stub": {},
    "wrong": {**RIGHT, "square": "return 2 * x"},  # doubles instead of squaring
    "syntax": {**RIGHT, "mean": "return sum(xs) / len(xs"},
    "crash_first": {**RIGHT, "double": "import os\nos._exit(3)"},
    "crash_last": {**RIGHT, "mean": "import os\nos._exit(3)"},
    "hang": {**RIGHT, "square": "while True:\n    pass"},
    "deaf": {**RIGHT, "square": DEAF_LOOP},
    "files": {**RIGHT, "double": "return 2 * x * int(open('data.txt').read() == '1')"},
}


@pytest.fixture(scope="module")
def self_graded(tmp_path_factory) -> dict:
    """Each SELF_GRADED case, filled in the released exercise and graded on its own checks."""
    root = tmp_path_factory.mktemp("self")
    released = released_fixture(root)
    paths = []
    for name, answers in SELF_GRADED.items():
        paths.append(write_notebook(root / name / "ex.ipynb", filled(released, answers)))
    (root / "files" / "data.txt").write_text("1")
    grades, problems = grade_notebooks(paths, None, timeout_s=3, jobs=2)
    assert problems == []
    return dict(zip(SELF_GRADED, grades, strict=True))


def test_a_correct_answer_scores_full_points(self_graded):
    grade = self_graded["correct"]
    assert grade.error is None
    assert scores(grade) == {"double": 2, "square": 1, "mean": 3}
    assert all(e.passed and e.error is None for e in grade.exercises)
    assert [e.number for e in grade.exercises] == [1, 2, 3]
    assert (grade.points, grade.max_points) == (6, 6)


def test_the_stub_scores_zero_and_says_it_is_not_answered(self_graded):
    grade = self_graded["stub"]
    assert grade.error is None
    assert scores(grade) == {"double": 0, "square": 0, "mean": 0}
    for exercise in grade.exercises:
        assert (
            exercise.error == "not answered yet: the starting code still raises NotImplementedError"
        )
        assert exercise.checked is None and exercise.where is None


def test_a_wrong_answer_loses_its_points_and_says_what_failed(self_graded):
    grade = self_graded["wrong"]
    assert scores(grade) == {"double": 2, "square": 0, "mean": 3}
    square = by_name(grade, "square")
    assert square.error == "AssertionError: square(4) == 16 is false: square(4) = 8"
    assert square.checked == "assert square(4) == 16"


def test_a_syntax_error_is_named_at_its_cell(self_graded):
    grade = self_graded["syntax"]
    assert scores(grade) == {"double": 2, "square": 1, "mean": 0}
    error = by_name(grade, "mean").error
    assert error.startswith("SyntaxError in your answer to exercise 3 (line 3): ")


@pytest.mark.parametrize(
    "case, lost, kept",
    [("crash_first", "double", {"square": 1, "mean": 3}), ("crash_last", "mean", {"double": 2})],
)
def test_a_crash_costs_only_its_exercise(self_graded, case, lost, kept):
    grade = self_graded[case]
    assert grade.error is None
    assert scores(grade) == {**{"double": 2, "square": 1, "mean": 3}, **kept, lost: 0}
    number = by_name(grade, lost).number
    assert by_name(grade, lost).error.startswith(
        f"Crash: the process checking exercise {number} ended (exit status 3)"
    )


@pytest.mark.parametrize("case", ["hang", "deaf"])
def test_a_check_past_its_time_limit_costs_only_its_exercise(self_graded, case):
    grade = self_graded[case]
    assert scores(grade) == {"double": 2, "square": 0, "mean": 3}
    assert by_name(grade, "square").error == (
        "Timeout: the check of exercise 2 ran longer than 3 s and was stopped"
    )


def test_files_beside_the_submission_can_be_read(self_graded):
    assert scores(self_graded["files"])["double"] == 2


def test_unreadable_notebooks_are_reported_not_raised(tmp_path):
    (tmp_path / "garbage.ipynb").write_text("{not json", encoding="utf-8")
    (tmp_path / "list.ipynb").write_text("[1, 2]", encoding="utf-8")
    (tmp_path / "no_cells.ipynb").write_text(
        '{"nbformat": 4, "nbformat_minor": 5, "metadata": {}}', encoding="utf-8"
    )
    grades, _ = grade_notebooks(sorted(tmp_path.glob("*.ipynb")))
    garbage, as_list, no_cells = grades
    assert garbage.error.startswith("not valid JSON: ")
    assert (garbage.exercises, garbage.points, garbage.max_points) == ([], 0, 0)
    assert as_list.error == "not a Jupyter notebook (expected a JSON object with nbformat 4)"
    assert no_cells.error.startswith("not a valid notebook: ")


# ---------------------------------------------------------------------------------------
# Against a reference


@pytest.fixture(scope="module")
def tampered(tmp_path_factory) -> pathlib.Path:
    """The released exercise as reference, and submissions that edit it in other ways."""
    root = tmp_path_factory.mktemp("tampered")
    released = released_fixture(root)
    # square is wrong, its check weakened so that the wrong answer passes, and a check of
    # the student's own worth 50 points added
    weakened = filled(released, {**RIGHT, "square": "return 2 * x"})
    weakened.cells[5].source = "# GRADED: 1 point\nassert True"
    weakened.cells.append(code("# GRADED: 50 points\nassert True"))
    write_notebook(root / "class" / "weakened.ipynb", weakened)
    # every check deleted; the answers are right
    deleted = filled(released, RIGHT)
    deleted.cells = [c for c in deleted.cells if graded_points(c.source) is None]
    write_notebook(root / "class" / "deleted.ipynb", deleted)
    # a tool gave every cell a new id and the student duplicated a check; square is wrong
    renamed = filled(released, {**RIGHT, "square": "return x + x"})
    renamed.cells.insert(6, nbformat.from_dict(dict(renamed.cells[5])))
    for i, cell in enumerate(renamed.cells):
        cell.id = f"other-{i}"
    del renamed.metadata["minillm"]
    write_notebook(root / "class" / "renamed.ipynb", renamed)
    return root


@pytest.fixture(scope="module")
def against_reference(tampered):
    names = ("weakened", "deleted", "renamed")
    paths = [tampered / "class" / f"{n}.ipynb" for n in names]
    grades, problems = grade_notebooks(paths, tampered / "exercises" / "ex.ipynb", TIMEOUT_S)
    assert problems == []
    return dict(zip(names, grades, strict=True))


def test_without_a_reference_the_notebook_grades_itself_and_says_what_changed(tampered):
    grade = grade_notebook(tampered / "class" / "weakened.ipynb", TIMEOUT_S)
    assert (grade.points, grade.max_points) == (56, 56)
    grade = grade_notebook(tampered / "class" / "deleted.ipynb", TIMEOUT_S)
    assert (grade.points, grade.max_points) == (0, 0)
    assert grade.notes[0] == (
        "exercise 1 (double) was released with a check that this notebook no longer has; "
        "grade it with --reference to count it"
    )
    assert len(grade.notes) == 3


def test_checks_and_points_come_from_the_reference(against_reference):
    grade = against_reference["weakened"]
    assert grade.error is None
    assert scores(grade) == {"double": 2, "square": 0, "mean": 3}
    assert (grade.points, grade.max_points) == (5, 6)


def test_deleted_checks_are_still_run(against_reference):
    assert scores(against_reference["deleted"]) == {"double": 2, "square": 1, "mean": 3}


def test_answers_are_found_by_their_functions_when_ids_are_lost(against_reference):
    grade = against_reference["renamed"]
    assert grade.error is None
    assert scores(grade) == {"double": 2, "square": 0, "mean": 3}


def test_a_solution_notebook_is_a_reference_too(tampered):
    grade = grade_notebook(
        tampered / "class" / "renamed.ipynb", TIMEOUT_S, tampered / "solutions" / "ex.ipynb"
    )
    assert scores(grade) == {"double": 2, "square": 0, "mean": 3}


def test_a_rerelease_with_inserted_cells_grades_old_submissions(tmp_path):
    old = released_fixture(tmp_path / "old")
    answers = {**RIGHT, "mean": "return sum(xs) / max(len(xs), 1)"}
    submission = write_notebook(tmp_path / "alice.ipynb", filled(old, answers))
    # the author inserts a new first exercise and a markdown cell, and gives mean's starting
    # code a docstring
    cells = list(SOLUTION_CELLS)
    cells[5] = code(cells[5].source.replace("(xs):", '(xs):\n    """Not of [] ."""'), "mean")
    new_exercise = [
        md("## Exercise 1: halve (1 point)"),
        code(
            "def halve(x):\n    ### BEGIN SOLUTION\n    return x / 2\n    ### END SOLUTION", "halve"
        ),
        code("# GRADED: 1 point\nassert halve(3) == 1.5", "halve-check"),
    ]
    cells = [
        cells[0],
        md("Read the preface first."),
        *new_exercise,
        *cells[1:],
    ]
    new = released_fixture(tmp_path / "new", cells)
    grade = grade_notebook(submission, TIMEOUT_S, new)
    assert grade.error is None
    assert [(e.number, e.name) for e in grade.exercises] == [
        (1, "halve"),
        (2, "double"),
        (3, "square"),
        (4, "mean"),
    ]
    assert scores(grade) == {"halve": 0, "double": 2, "square": 1, "mean": 3}
    halve = by_name(grade, "halve")
    assert halve.error == "no answer: no cell of the notebook defines `halve`"
    assert halve.notes == [
        "this exercise is not in your copy of the notebook: it was added after your copy was "
        "released"
    ]
    assert by_name(grade, "double").notes == []
    assert by_name(grade, "mean").notes == [
        "the statement or starting code of this exercise changed after your copy was "
        "released; compare your copy with the current one"
    ]


def test_a_reference_folder_matches_renamed_submissions(tmp_path):
    released_fixture(tmp_path)
    other = [
        md("# Another chapter"),
        code(
            "def triple(x):\n    ### BEGIN SOLUTION\n    return 3 * x\n    ### END SOLUTION",
            "triple",
        ),
        code("# GRADED: 1 point\nassert triple(2) == 6", "triple-check"),
    ]
    write_notebook(tmp_path / "solutions" / "other.ipynb", notebook(other))
    from minillm.course.exercises import release

    release(tmp_path / "solutions", tmp_path / "exercises", REPO_URL)
    released = tmp_path / "exercises" / "ex.ipynb"
    by_metadata = write_notebook(tmp_path / "alice_ex.ipynb", filled(released, RIGHT))
    stripped = filled(released, RIGHT)
    del stripped.metadata["minillm"]
    by_functions = write_notebook(tmp_path / "bob-final.ipynb", stripped)
    folder = tmp_path / "exercises"
    assert match_reference(read_notebook(by_metadata), by_metadata, folder) == (
        released,
        "metadata",
    )
    assert match_reference(read_notebook(by_functions), by_functions, folder) == (
        released,
        "functions it defines",
    )
    grades, _ = grade_notebooks([by_metadata, by_functions], folder, TIMEOUT_S)
    assert [(g.reference, g.points) for g in grades] == [(str(released), 6), (str(released), 6)]


# ---------------------------------------------------------------------------------------
# Isolation


@needs_landlock
def test_submissions_cannot_reach_each_other_or_the_reference(tmp_path):
    released = released_fixture(tmp_path)
    bob_path = tmp_path / "class" / "bob.ipynb"
    # alice's double overwrites bob's notebook and the reference, then answers right
    targets = [str(bob_path), str(released)]
    attack = f"for p in {targets!r}:\n    open(p, 'w').write('{{}}')\nreturn 2 * x"
    alice = write_notebook(
        tmp_path / "class" / "alice.ipynb", filled(released, {**RIGHT, "double": attack})
    )
    # carol's square reads bob's answers
    spy = f"return len(open({str(bob_path)!r}).read()) and x * x"
    carol = write_notebook(
        tmp_path / "class" / "carol.ipynb", filled(released, {**RIGHT, "square": spy})
    )
    write_notebook(bob_path, filled(released, RIGHT))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.ipynb")}
    grades, problems = grade_notebooks([alice, bob_path, carol], released, TIMEOUT_S, jobs=2)
    assert problems == []
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.ipynb")} == before
    alice_grade, bob_grade, carol_grade = grades
    assert scores(alice_grade) == {"double": 0, "square": 1, "mean": 3}
    assert by_name(alice_grade, "double").error.startswith("PermissionError: ")
    assert scores(bob_grade) == {"double": 2, "square": 1, "mean": 3}
    assert scores(carol_grade) == {"double": 2, "square": 0, "mean": 3}
    assert by_name(carol_grade, "square").error.startswith("PermissionError: ")


def test_one_submissions_state_does_not_reach_the_next(tmp_path):
    """Module state set by one student's check is gone for the next student."""
    released = released_fixture(tmp_path)
    # the first student's double stores a flag in a module both checks can reach
    setter = "import json\njson.minillm_flag = True\nreturn 2 * x"
    reader = "import json\nreturn 2 * x if not hasattr(json, 'minillm_flag') else 0"
    first = write_notebook(tmp_path / "a.ipynb", filled(released, {**RIGHT, "double": setter}))
    second = write_notebook(tmp_path / "b.ipynb", filled(released, {**RIGHT, "double": reader}))
    grades, _ = grade_notebooks([first, second], released, TIMEOUT_S)
    assert scores(grades[1])["double"] == 2


# ---------------------------------------------------------------------------------------
# Reports and the command line


@pytest.fixture(scope="module")
def class_folder(tmp_path_factory) -> pathlib.Path:
    """Renamed submissions, as a learning platform names them, and a broken one."""
    root = tmp_path_factory.mktemp("class")
    released = released_fixture(root)
    submissions = root / "submissions"
    write_notebook(submissions / "alice_ex.ipynb", filled(released, RIGHT))
    write_notebook(
        submissions / "bob" / "attempt2.ipynb",
        filled(released, {**RIGHT, "square": "return 2 * x"}),
    )
    write_notebook(submissions / "carol.ipynb", filled(released, {}))
    (submissions / "dave.ipynb").write_text("{not json", encoding="utf-8")
    return root


def test_cli_grades_a_class_into_a_table_and_reports(class_folder, tmp_path, capsys):
    report = tmp_path / "grades.csv"
    feedback = tmp_path / "feedback"
    argv = [
        "grade",
        str(class_folder / "submissions"),
        "--reference",
        str(class_folder / "exercises"),
        "-j",
        "2",
        "--report",
        str(report),
        "--feedback",
        str(feedback),
    ]
    assert main(argv) == 1  # dave's notebook could not be read
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"checks from {class_folder / 'exercises' / 'ex.ipynb'}"
    assert lines[1].split() == ["student", "1", "2", "3", "total"]
    assert lines[2].split() == ["alice_ex", "2", "1", "3", "6/6"]
    assert lines[3].split() == ["bob/attempt2", "2", "0", "3", "5/6"]
    assert lines[4].split() == ["carol", "0", "0", "0", "0/6"]
    assert lines[5].split()[:3] == ["dave", "-", "-"]
    assert "not graded: not valid JSON" in lines[5]
    assert lines[6].split() == ["max", "2", "1", "3"]
    assert lines[7] == "exercises: 1 double, 2 square, 3 mean"
    with report.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [
        (r["student"], r["1 double"], r["2 square"], r["3 mean"], r["points"]) for r in rows
    ] == [
        ("alice_ex", "2", "1", "3", "6"),
        ("bob/attempt2", "2", "0", "3", "5"),
        ("carol", "0", "0", "0", "0"),
        ("dave", "", "", "", "0"),
    ]
    with report.with_name("grades.exercises.csv").open(newline="") as f:
        detail = list(csv.DictReader(f))
    bob_square = [r for r in detail if r["student"] == "bob/attempt2" and r["name"] == "square"]
    assert bob_square[0]["error"] == "AssertionError: square(4) == 16 is false: square(4) = 8"
    assert bob_square[0]["checked"] == "assert square(4) == 16"
    text = (feedback / "bob__attempt2.txt").read_text()
    assert "square(4) == 16 is false: square(4) = 8" in text
    assert text.splitlines()[-1].split() == ["total", "5/6"]


def test_json_report_holds_each_exercise(class_folder, tmp_path):
    grades, _ = grade_notebooks(
        [class_folder / "submissions" / "bob" / "attempt2.ipynb"],
        class_folder / "exercises",
        TIMEOUT_S,
    )
    report = tmp_path / "grades.json"
    write_report(grades, report)
    [nb] = json.loads(report.read_text())["notebooks"]
    assert (nb["points"], nb["max_points"], nb["error"]) == (5, 6, None)
    square = nb["exercises"][1]
    assert {k: square[k] for k in ("exercise", "name", "points", "max_points", "passed")} == {
        "exercise": 2,
        "name": "square",
        "points": 0,
        "max_points": 1,
        "passed": False,
    }
    assert square["checked"] == "assert square(4) == 16"


def test_cli_one_notebook_shows_its_feedback(class_folder, capsys):
    path = class_folder / "submissions" / "bob" / "attempt2.ipynb"
    assert main(["grade", str(path), "--reference", str(class_folder / "exercises")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["exercise", "name", "points", "result"]
    assert lines[2].split() == ["1", "double", "2/2", "passed"]
    assert lines[3].split()[:4] == ["2", "square", "0/1", "failed:"]
    assert lines[4].split() == ["checked:", "assert", "square(4)", "==", "16"]
    assert lines[-1].split() == ["total", "5/6"]


def test_cli_reports_bad_paths_and_continues(class_folder, tmp_path, capsys):
    missing = tmp_path / "missing.ipynb"
    (tmp_path / "notes.txt").write_text("hello")
    good = class_folder / "submissions" / "alice_ex.ipynb"
    status = main(["grade", str(missing), str(tmp_path / "notes.txt"), str(good)])
    assert status == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[:2] == [
        f"minillm grade: {missing}: no such file or folder",
        f"minillm grade: {tmp_path / 'notes.txt'}: not a notebook (expected an .ipynb file "
        "or a folder)",
    ]
    assert out.splitlines()[-1].split() == ["total", "6/6"]


def test_cli_exit_status_is_0_when_everything_was_graded_whatever_the_score(class_folder):
    assert main(["grade", str(class_folder / "submissions" / "carol.ipynb")]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["grade", "x.ipynb", "--report", "grades.txt"],
        ["grade", "x.ipynb", "--timeout", "0"],
        ["grade", "x.ipynb", "--jobs", "0"],
        ["grade", "x.ipynb", "--reference", "no/such/folder"],
    ],
)
def test_cli_rejects_bad_options_before_grading(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("minillm grade: ")


def test_cli_refuses_several_notebooks_without_a_reference(class_folder, capsys):
    assert main(["grade", str(class_folder / "submissions")]) == 2
    assert "several notebooks need --reference" in capsys.readouterr().err


def test_csv_cells_never_start_a_formula(tmp_path):
    formula = '=HYPERLINK("http://example.invalid/?x="&A1,"details")'
    exercise = ExerciseGrade(1, "double", "Double", 2, passed=False, error=f"{formula}: x")
    exercise.flags.append("suspicious code: reads the call stack (_getframe)")
    grade = NotebookGrade("a.ipynb", [exercise], student="+cmd", reference="ref.ipynb")
    written = write_report([grade], tmp_path / "grades.csv")
    for path in written:
        rows = list(csv.reader(path.open(encoding="utf-8")))
        cells = [cell for row in rows[1:] for cell in row]
        assert not [c for c in cells if c[:1] in ("=", "+", "-", "@")], path
        assert "'+cmd" in cells
    detail = list(csv.DictReader(written[1].open(encoding="utf-8")))
    assert detail[0]["error"] == f"'{formula}: x"
    assert detail[0]["flags"] == "suspicious code: reads the call stack (_getframe)"


@pytest.mark.parametrize("euid", [0, 1000])
def test_every_report_says_when_the_process_limit_cannot_hold(
    class_folder, capsys, monkeypatch, tmp_path, euid
):
    """The kernel does not hold root to RLIMIT_NPROC: grading as root says so, in the
    feedback, the table, the CSV and the JSON, not only on stderr."""
    import minillm.course.sandbox as sandbox

    monkeypatch.setattr(sandbox.os, "geteuid", lambda: euid)
    monkeypatch.setattr(sandbox, "pids_cgroup", lambda: None)  # none to take its place
    path = class_folder / "submissions" / "bob" / "attempt2.ipynb"
    reference = str(class_folder / "exercises")
    main(["grade", str(path), "--reference", reference, "--report", str(tmp_path / "g.csv")])
    main(["grade", str(path), "--reference", reference, "--report", str(tmp_path / "g.json")])
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if "RLIMIT_NPROC" in line]
    feedback = [line for line in out.splitlines() if "RLIMIT_NPROC" in line]
    [row] = list(csv.DictReader((tmp_path / "g.csv").open(encoding="utf-8")))
    details = list(csv.DictReader((tmp_path / "g.exercises.csv").open(encoding="utf-8")))
    [notebook] = json.loads((tmp_path / "g.json").read_text())["notebooks"]
    limits = [m for m in notebook["limits_not_applied"] if m.startswith("RLIMIT_NPROC")]
    if euid == 0:
        assert limits == [
            "RLIMIT_NPROC: the grader runs as root, whom the kernel does not hold to it, and "
            "no cgroup v1 `pids` hierarchy is writable here, so the number of processes a "
            "submission starts is limited only by the time limit, which kills them all"
        ]
        assert warnings == [f"minillm grade: warning: limit not applied: {limits[0]}"] * 2
        assert feedback == [f"  limit not applied: {limits[0]}"] * 2
        assert limits[0] in row["limits_not_applied"]
        assert all(limits[0] in d["limits_not_applied"] for d in details)
    else:
        assert (limits, warnings, feedback) == ([], [], [])
        assert "RLIMIT_NPROC" not in row["limits_not_applied"]


# a fork bomb held to 1,000 processes (each sleeps): the machine survives a limit that
# does not hold
FORK_BOMB = """import os
import time

made = 0
while made < 1000:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    made += 1
print(f"forked {made}")
return made"""


def test_a_fork_bomb_is_stopped_and_fails_its_exercise_alone(tmp_path):
    """As root, whom RLIMIT_NPROC does not hold, the student's process runs in a cgroup of
    its own whose `pids.max` stops the bomb; the group is removed afterwards."""
    from minillm.course import sandbox

    missing = sandbox.limits_not_applied()
    if any(m.startswith("RLIMIT_NPROC") for m in missing):
        pytest.skip("no limit on processes here (root, and no writable cgroup v1 pids)")
    released = released_fixture(tmp_path)
    path = write_notebook(
        tmp_path / "bomb" / "ex.ipynb", filled(released, {**RIGHT, "double": FORK_BOMB})
    )
    [grade], problems = grade_notebooks([path], None, timeout_s=TIMEOUT_S, jobs=1)
    assert problems == []
    assert scores(grade) == {"double": 0, "square": 1, "mean": 3}
    [made] = [
        int(line.split()[1])
        for line in by_name(grade, "double").output.splitlines()
        if line.startswith("forked")
    ]
    assert 0 < made <= sandbox.SPARE_PROCESSES, made
    parent = sandbox.pids_cgroup()
    if parent is not None:  # each student process's group is gone (others are live graders')
        left = [re.match(r"minillm-(?:probe-)?(\d+)", n) for n in os.listdir(parent)]
        assert [m[0] for m in left if m and not os.path.exists(f"/proc/{m[1]}")] == []


def test_the_class_table_names_each_limit_not_applied():
    exercise = ExerciseGrade(1, "double", "Double", 2, passed=True)
    missing = ["seccomp: not available here", "Landlock: not in this system's kernel"]
    grades = [
        NotebookGrade(f"{who}.ipynb", [exercise], reference="ref.ipynb", limits_not_applied=missing)
        for who in ("a", "b")
    ]
    lines = format_summary(grades).splitlines()
    assert [line for line in lines if line.startswith("limit not applied")] == [
        "limit not applied: seccomp: not available here",
        "limit not applied: Landlock: not in this system's kernel",
    ]
