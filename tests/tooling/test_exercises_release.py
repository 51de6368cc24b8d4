"""`minillm exercises release` and `check`: exercises/ generated from solutions/."""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat
import pytest

from minillm.cli.main import main
from minillm.course.bootstrap import bootstrap_source
from minillm.course.exercises import (
    ReleaseError,
    fix_bootstrap,
    release,
    stale_exercises,
    strip_solutions,
)

from .conftest import REPO_URL, SOLUTION_CELLS, code, md, notebook, replace_source, write_notebook

STUB = '# YOUR CODE HERE\nraise NotImplementedError("replace this line with your solution")'

SOURCE = '''def f(x):
    """Doc."""
    y = x + 1
    ### BEGIN SOLUTION
    z = y * 2
    return z
    ### END SOLUTION


def g(items):
    for item in items:
        if item:
            ### BEGIN SOLUTION
            print(item)
            ### END SOLUTION
    return None

### BEGIN SOLUTION
ANSWER = 42
### END SOLUTION
print(ANSWER)'''

EXPECTED = '''def f(x):
    """Doc."""
    y = x + 1
    # YOUR CODE HERE
    raise NotImplementedError("replace this line with your solution")


def g(items):
    for item in items:
        if item:
            # YOUR CODE HERE
            raise NotImplementedError("replace this line with your solution")
    return None

# YOUR CODE HERE
raise NotImplementedError("replace this line with your solution")
print(ANSWER)'''


def test_strip_solutions_replaces_each_region_at_its_indentation():
    assert strip_solutions(SOURCE) == EXPECTED


def test_strip_solutions_leaves_code_without_markers_alone():
    assert strip_solutions("x = 1\n\nprint(x)\n") == "x = 1\n\nprint(x)\n"


def released(project) -> nbformat.NotebookNode:
    return nbformat.read(project.exercises / "ch01_fixture.ipynb", as_version=4)


def test_release_writes_the_specified_notebook(project):
    solution = notebook(SOLUTION_CELLS + [code(SOURCE)])
    # What a saved, executed solution carries and the exercise must not.
    solution.metadata.update(
        {
            "language_info": {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"},
            "widgets": {"state": {}},
            "jupytext": {"formats": "ipynb"},
        }
    )
    for i, cell in enumerate(solution.cells):
        if cell.cell_type == "code":
            cell.execution_count = i + 1
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="out\n")]
        cell.metadata = {
            "tags": ["keep"],
            "collapsed": True,
            "scrolled": True,
            "execution": {"iopub.status.busy": "2026-01-01T00:00:00.000000Z"},
        }
    solution.cells[1].attachments = {"fig.png": {"image/png": "iVBORw0KGgo="}}
    write_notebook(project.solutions / "ch01_fixture.ipynb", solution)

    release(project.solutions, project.exercises, REPO_URL)
    nb = released(project)

    # the title comes first, above the bootstrap; every other cell keeps its place
    order = [1, 0, *range(2, len(solution.cells))]
    assert [c.cell_type for c in nb.cells] == [solution.cells[i].cell_type for i in order]
    assert nb.cells[0].source == "# A fixture exercise"
    assert nb.cells[0].attachments == {"fig.png": {"image/png": "iVBORw0KGgo="}}
    assert nb.cells[1].source == bootstrap_source(REPO_URL)
    assert nb.cells[2].source == f"def double(x):\n    {STUB.replace(chr(10), chr(10) + '    ')}"
    assert nb.cells[3].source == solution.cells[3].source  # graded cells are kept as they are
    assert nb.cells[-1].source == EXPECTED
    for cell, i in zip(nb.cells, order, strict=True):
        assert cell.id == solution.cells[i].id
        # a graded cell is collapsed in the book, its other tags kept
        graded = cell.source.startswith("# GRADED")
        assert cell.metadata == {"tags": ["keep", "hide-input"] if graded else ["keep"]}
        if cell.cell_type == "code":
            assert cell.outputs == []
            assert cell.execution_count is None
    recorded = nb.metadata.pop("minillm")
    assert nb.metadata == {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    assert recorded["notebook"] == "ch01_fixture"
    assert [(e["number"], e["name"], e["points"]) for e in recorded["exercises"]] == [
        (1, "double", 2),
        (2, "square", 1),
        (3, "mean", 3),
    ]
    double = recorded["exercises"][0]
    assert double["functions"] == ["double"]
    assert double["answer_cells"] == {"double": nb.cells[2].source}
    assert len(double["version"]) == 12
    assert (nb.nbformat, nb.nbformat_minor) == (4, 5)
    nbformat.validate(nb)


def test_release_twice_gives_identical_bytes(project):
    write_notebook(project.solutions / "ch01_fixture.ipynb", notebook(SOLUTION_CELLS))
    write_notebook(project.solutions / "ch02_other.ipynb", notebook([code("x = 1")]))
    assert release(project.solutions, project.exercises, REPO_URL) == [
        f"wrote {project.exercises / 'ch01_fixture.ipynb'}",
        f"wrote {project.exercises / 'ch02_other.ipynb'}",
        f"wrote {project.exercises / 'conftest.py'}",
    ]
    first = {p.name: p.read_bytes() for p in project.exercises.iterdir()}
    assert release(project.solutions, project.exercises, REPO_URL) == []
    assert {p.name: p.read_bytes() for p in project.exercises.iterdir()} == first
    text = first["ch01_fixture.ipynb"].decode()
    assert text.endswith("}\n") and json.loads(text)["nbformat_minor"] == 5


def test_release_removes_exercises_whose_solution_is_gone(project):
    write_notebook(project.solutions / "ch01_fixture.ipynb", notebook(SOLUTION_CELLS))
    write_notebook(project.exercises / "ch09_old.ipynb", notebook([code("x = 1")]))
    release(project.solutions, project.exercises, REPO_URL)
    assert sorted(p.name for p in project.exercises.iterdir()) == [
        "ch01_fixture.ipynb",
        "conftest.py",
    ]


@pytest.mark.parametrize(
    "source, problem",
    [
        ("### BEGIN SOLUTION\nx = 1", "line 1: ### BEGIN SOLUTION is never closed"),
        ("x = 1\n### END SOLUTION", "line 2: ### END SOLUTION without a ### BEGIN SOLUTION"),
        (
            "### BEGIN SOLUTION\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n### END SOLUTION",
            "line 2: ### BEGIN SOLUTION inside the region opened at line 1",
        ),
    ],
    ids=["unclosed", "unopened", "nested"],
)
def test_bad_markers_name_notebook_and_cell_and_nothing_is_written(project, source, problem):
    write_notebook(project.solutions / "ch01_good.ipynb", notebook(SOLUTION_CELLS))
    bad = notebook([md("# Bad"), code("y = 2"), code(source)])
    write_notebook(project.solutions / "ch02_bad.ipynb", bad)
    with pytest.raises(ReleaseError) as err:
        release(project.solutions, project.exercises, REPO_URL)
    [message] = err.value.problems
    assert message.startswith(f"{project.solutions / 'ch02_bad.ipynb'}: cell 3: {problem}")
    assert not project.exercises.exists()  # not even the good notebook


def test_every_problem_of_every_notebook_is_reported(project):
    write_notebook(project.solutions / "ch01.ipynb", notebook([code("### END SOLUTION")]))
    write_notebook(project.solutions / "ch02.ipynb", notebook([md("### BEGIN SOLUTION\nhi")]))
    write_notebook(project.solutions / "ch03.ipynb", notebook([code("# GRADED: two points")]))
    (project.solutions / "ch04.ipynb").write_text("{not json", encoding="utf-8")
    with pytest.raises(ReleaseError) as err:
        release(project.solutions, project.exercises, REPO_URL)
    problems = err.value.problems
    assert [p.split(": ", 1)[0] for p in problems] == [
        str(project.solutions / f"ch0{i}.ipynb") for i in (1, 2, 3, 4)
    ]
    assert "cell 1: line 1: ### END SOLUTION without" in problems[0]
    assert "cell 1: solution markers in a markdown cell" in problems[1]
    assert "cell 1: malformed '# GRADED: two points'" in problems[2]
    assert "not valid JSON" in problems[3]


def test_release_refuses_a_solution_without_the_bootstrap(project):
    write_notebook(project.solutions / "ch01.ipynb", notebook(SOLUTION_CELLS, bootstrap=False))
    with pytest.raises(
        ReleaseError, match=r"ch01.ipynb: cell 0: not the bootstrap cell .*--fix-bootstrap"
    ):
        release(project.solutions, project.exercises, REPO_URL)


def test_fix_bootstrap_inserts_or_replaces_the_first_cell(project):
    missing = write_notebook(
        project.solutions / "ch01.ipynb", notebook(SOLUTION_CELLS, bootstrap=False)
    )
    outdated_nb = notebook(SOLUTION_CELLS)
    replace_source(outdated_nb, 0, REPO_URL, "https://example.org/old/place")
    outdated = write_notebook(project.solutions / "ch02.ipynb", outdated_nb)
    current = write_notebook(project.solutions / "ch03.ipynb", notebook(SOLUTION_CELLS))
    current_bytes = current.read_bytes()

    assert fix_bootstrap(project.solutions, REPO_URL) == [missing, outdated]

    assert current.read_bytes() == current_bytes
    for path in (missing, outdated):
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[0].source == bootstrap_source(REPO_URL)
        assert [c.source for c in nb.cells[1:]] == [c.source for c in SOLUTION_CELLS]
    assert fix_bootstrap(project.solutions, REPO_URL) == []


def test_stale_exercises_are_named(project):
    write_notebook(project.solutions / "ch01_fixture.ipynb", notebook(SOLUTION_CELLS))
    write_notebook(project.solutions / "ch02_other.ipynb", notebook([code("x = 1")]))
    release(project.solutions, project.exercises, REPO_URL)
    assert stale_exercises(project.solutions, project.exercises, REPO_URL) == []

    edited = project.exercises / "ch01_fixture.ipynb"
    edited.write_text(edited.read_text().replace("double", "triple"))
    (project.exercises / "ch02_other.ipynb").unlink()
    (project.exercises / "conftest.py").write_text("")
    write_notebook(project.exercises / "ch03_orphan.ipynb", notebook([code("x = 1")]))
    assert stale_exercises(project.solutions, project.exercises, REPO_URL) == [
        f"{edited}: differs from its solution {project.solutions / 'ch01_fixture.ipynb'}",
        f"{project.exercises / 'ch02_other.ipynb'}: missing",
        f"{project.exercises / 'conftest.py'}: differs from release's",
        f"{project.exercises / 'ch03_orphan.ipynb'}: has no source in {project.solutions}",
    ]


def test_cli_release_then_check(project, capsys):
    write_notebook(project.solutions / "ch01_fixture.ipynb", notebook(SOLUTION_CELLS))
    assert main(["exercises", "check", *project.cli_folders()]) == 1
    assert f"stale: {project.exercises / 'ch01_fixture.ipynb'}: missing" in capsys.readouterr().err

    assert main(["exercises", "release", *project.cli_folders()]) == 0
    assert f"wrote {project.exercises / 'ch01_fixture.ipynb'}" in capsys.readouterr().out
    assert main(["exercises", "check", *project.cli_folders()]) == 0

    solution = notebook(SOLUTION_CELLS)
    replace_source(solution, 2, "2 * x", "x + x")
    write_notebook(project.solutions / "ch01_fixture.ipynb", solution)
    assert main(["exercises", "check", *project.cli_folders()]) == 0  # the solution is hidden
    replace_source(solution, 1, "fixture", "changed")
    write_notebook(project.solutions / "ch01_fixture.ipynb", solution)
    assert main(["exercises", "check", *project.cli_folders()]) == 1
    assert "ch01_fixture.ipynb: differs from its solution" in capsys.readouterr().err


def test_cli_defaults_to_the_repository_folders(project, monkeypatch, capsys):
    (project.root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    write_notebook(project.solutions / "ch01_fixture.ipynb", notebook(SOLUTION_CELLS))
    monkeypatch.chdir(project.solutions)  # any folder inside the repository
    assert main(["exercises", "release"]) == 0
    assert (project.exercises / "ch01_fixture.ipynb").exists()
    assert main(["exercises", "check"]) == 0


def test_cli_release_errors_write_nothing_and_exit_1(project, capsys):
    write_notebook(project.solutions / "ch01.ipynb", notebook([code("### BEGIN SOLUTION")]))
    assert main(["exercises", "release", *project.cli_folders()]) == 1
    err = capsys.readouterr().err
    assert "no exercise written" in err and f"{project.solutions / 'ch01.ipynb'}: cell 1:" in err
    assert not project.exercises.exists()


def test_cli_fix_bootstrap(project):
    path = write_notebook(
        project.solutions / "ch01.ipynb", notebook(SOLUTION_CELLS, bootstrap=False)
    )
    assert main(["exercises", "release", *project.cli_folders()]) == 1
    assert main(["exercises", "release", "--fix-bootstrap", *project.cli_folders()]) == 0
    assert nbformat.read(path, as_version=4).cells[0].source == bootstrap_source(REPO_URL)
    assert main(["exercises", "check", *project.cli_folders()]) == 0


def test_cli_reports_a_missing_config(project, capsys):
    project.config.unlink()
    write_notebook(project.solutions / "ch01.ipynb", notebook(SOLUTION_CELLS))
    assert main(["exercises", "release", *project.cli_folders()]) == 1
    assert "_config.yml not found" in capsys.readouterr().err
    assert not project.exercises.exists()


def test_release_keeps_the_solutions_ids_through_inserted_cells(project):
    path = write_notebook(project.solutions / "ch01_fixture.ipynb", notebook(SOLUTION_CELLS))
    release(project.solutions, project.exercises, REPO_URL)
    before = {c.id: c.source for c in released(project).cells}
    solution = nbformat.read(path, as_version=4)
    solution.cells[1:1] = [md("A new introduction."), code("LIMIT = 3")]
    write_notebook(path, solution)
    release(project.solutions, project.exercises, REPO_URL)
    after = {c.id: c.source for c in released(project).cells}
    assert {k: v for k, v in after.items() if k in before} == before
    assert [c.id for c in released(project).cells][4:] == [
        "double",
        "double-check",
        "square",
        "square-check",
        "mean",
        "mean-check",
    ]


def test_release_refuses_ids_not_derived_from_names_and_fix_ids_gives_them(project, capsys):
    solution = notebook(SOLUTION_CELLS)
    solution.cells[3].id = "cell-3"
    path = write_notebook(project.solutions / "ch01.ipynb", solution)
    assert main(["exercises", "release", *project.cli_folders()]) == 1
    err = capsys.readouterr().err
    assert (
        "exercise 1 (double): cell ids ['double', 'cell-3'] should be ['double', 'double-check']; "
        "run `minillm exercises release --fix-ids`"
    ) in err
    assert main(["exercises", "release", "--fix-ids", *project.cli_folders()]) == 0
    assert nbformat.read(path, as_version=4).cells[3].id == "double-check"


def test_release_refuses_two_exercises_of_one_name(project):
    cells = [
        *SOLUTION_CELLS[1:3],
        code(SOLUTION_CELLS[1].source, "double-2"),
        code("# GRADED: 1 point"),
    ]
    write_notebook(project.solutions / "ch01.ipynb", notebook(cells))
    with pytest.raises(ReleaseError, match="exercise 2: named 'double' like exercise 1"):
        release(project.solutions, project.exercises, REPO_URL)


def test_release_refuses_a_check_that_needs_an_earlier_check(project):
    cells = [
        SOLUTION_CELLS[1],
        code("# GRADED: 2 points\nEXPECTED = 6\nassert double(3) == EXPECTED", "double-check"),
        SOLUTION_CELLS[3],
        code("# GRADED: 1 point\nassert square(3) == EXPECTED + 3", "square-check"),
    ]
    write_notebook(project.solutions / "ch01.ipynb", notebook(cells))
    with pytest.raises(
        ReleaseError, match="the check of exercise 2 uses EXPECTED, which only an earlier check"
    ):
        release(project.solutions, project.exercises, REPO_URL)


def test_pytest_names_graded_cells_by_their_exercise(project):
    write_notebook(project.solutions / "ch01_fixture.ipynb", notebook(SOLUTION_CELLS))
    release(project.solutions, project.exercises, REPO_URL)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbval-lax",
            "-p",
            "no:cacheprovider",
            "-q",
            "exercises/ch01_fixture.ipynb",
        ],
        cwd=project.root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    failed = [
        line.split(" - ")[0] for line in result.stdout.splitlines() if line.startswith("FAILED")
    ]
    assert failed == [f"FAILED exercises/ch01_fixture.ipynb::Exercise {n}" for n in (1, 2, 3)]
    assert "Exercise 2: Cell execution caused an exception" in result.stdout
