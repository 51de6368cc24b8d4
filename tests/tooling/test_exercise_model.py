"""How grading reads notebooks: exercises and their ids, the student's cells, the definitions
taken from them, and the feedback of a failed check. No process is started here."""

from __future__ import annotations

import nbformat
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.course.exercise_model import (
    assign_release_ids,
    parse_exercises,
    python_source,
    student_code,
)
from minillm.course.sandbox import compile_check, describe_failure, statements

from .conftest import RIGHT, SOLUTION_CELLS, code, filled, md, notebook, released_fixture


def test_a_solution_reads_as_exercises_and_steps():
    exercises = parse_exercises(notebook(SOLUTION_CELLS))
    assert [(e.number, e.name, e.points) for e in exercises.exercises] == [
        (1, "double", 2),
        (2, "square", 1),
        (3, "mean", 3),
    ]
    double = exercises.exercises[0]
    assert double.functions == ("double",)
    assert (double.answer_ids, double.answer_cells, double.check_id, double.check_cell) == (
        ("double",),
        (2,),
        "double-check",
        3,
    )
    assert "raise NotImplementedError" in double.starters[0]
    # the bootstrap is skipped; answer cells run as their starters; checks in place
    assert [(s.kind, s.index) for s in exercises.steps] == [
        ("setup", 2),
        ("check", 3),
        ("setup", 4),
        ("check", 5),
        ("setup", 6),
        ("check", 7),
    ]
    assert exercises.steps[0].source == double.starters[0]


def test_the_released_exercise_reads_the_same(tmp_path):
    released = nbformat.read(released_fixture(tmp_path), as_version=4)
    from_solution = parse_exercises(notebook(SOLUTION_CELLS))
    assert parse_exercises(released).exercises == from_solution.exercises


def test_a_filled_in_copy_finds_its_starters_in_the_metadata(tmp_path):
    nb = filled(released_fixture(tmp_path), RIGHT)
    exercises = parse_exercises(nb)
    assert [e.name for e in exercises.exercises] == ["double", "square", "mean"]
    assert "NotImplementedError" in exercises.steps[0].source  # the starter, not the answer
    assert "2 * x" not in exercises.steps[0].source


def test_headings_titles_and_versions():
    cells = [
        md("## Exercise 1: doubling (2 points)\n\nWrite `double`."),
        *SOLUTION_CELLS[1:3],
        md("## Exercise 2: squaring (1 point)"),
        *SOLUTION_CELLS[3:5],
    ]
    exercises = parse_exercises(notebook(cells)).exercises
    assert [(e.number, e.title) for e in exercises] == [(1, "doubling"), (2, "squaring")]
    # a version is the same whatever the exercise's number
    halve = [
        md("## Exercise 1: halving (1 point)"),
        code(
            "def halve(x):\n    ### BEGIN SOLUTION\n    return x / 2\n    ### END SOLUTION", "halve"
        ),
        code("# GRADED: 1 point\nassert halve(2) == 1", "halve-check"),
    ]
    renumbered = [*halve, md("## Exercise 2: doubling (2 points)\n\nWrite `double`."), *cells[1:3]]
    assert parse_exercises(notebook(renumbered)).exercises[1].version == exercises[0].version
    reworded = [md("## Exercise 1: doubling (2 points)\n\nWrite `double(x)`."), *cells[1:]]
    assert parse_exercises(notebook(reworded)).exercises[0].version != exercises[0].version


def test_a_graded_cell_under_another_exercises_heading_is_an_error():
    cells = [md("## Exercise 2: doubling (2 points)"), *SOLUTION_CELLS[1:3]]
    with pytest.raises(ValueError, match=r"^cell 3: graded cell 1 sits under the heading"):
        parse_exercises(notebook(cells))


def test_a_timing_check_is_tagged():
    check = code("# GRADED: 1 point\nassert double(1) == 2", "double-check")
    check.metadata["tags"] = ["timing"]
    cells = [SOLUTION_CELLS[1], check]
    assert parse_exercises(notebook(cells)).exercises[0].timing


def test_release_ids_derive_from_the_names():
    nb = notebook(SOLUTION_CELLS)
    for cell in nb.cells[2:]:
        cell.id = f"random-{cell.id}"
    assert assign_release_ids(nb)
    assert [c.id for c in nb.cells[2:]] == [
        "double",
        "double-check",
        "square",
        "square-check",
        "mean",
        "mean-check",
    ]
    assert not assign_release_ids(nb)


def test_release_ids_refuse_to_take_another_cells_id():
    nb = notebook(SOLUTION_CELLS)
    nb.cells[2].id = "x"
    nb.cells[1].id = "double"
    with pytest.raises(ValueError, match="taken by cells that are not exercise cells"):
        assign_release_ids(nb)


# ---------------------------------------------------------------------------------------
# The student's cells


def test_answers_are_matched_by_id_then_by_the_functions_they_define(tmp_path):
    released = released_fixture(tmp_path)
    reference = parse_exercises(nbformat.read(released, as_version=4))
    nb = filled(released, RIGHT)
    nb.cells[4].id = "something-else"  # square's answer lost its id
    nb.cells.insert(5, code("def helper(x):\n    return x"))  # a cell of the student's own
    found = student_code(nb, reference)
    assert [(c.exercise, c.filename, c.cell_index) for c in found.cells] == [
        (0, "<your answer to exercise 1>", 2),
        (1, "<your answer to exercise 2>", 4),
        (1, "<your cell 5>", 5),
        (2, "<your answer to exercise 3>", 7),
    ]
    assert (found.errors, found.notes, found.general) == ({}, {}, [])


def test_edited_setup_cells_are_the_references_and_say_so(tmp_path):
    cells = [code("LIMIT = 3", "setup"), *SOLUTION_CELLS[1:3]]
    released = released_fixture(tmp_path, cells)
    reference = parse_exercises(nbformat.read(released, as_version=4))
    nb = filled(released, {"double": RIGHT["double"]})
    nb.cells[1].source = "LIMIT = 30"
    found = student_code(nb, reference)
    assert [c.filename for c in found.cells] == ["<your answer to exercise 1>"]
    assert found.general == [
        "cell 1 differs from the reference's: only answer cells are yours, so the grader runs "
        "the reference's version"
    ]


def test_a_syntax_error_fails_its_exercise_and_is_noted_after_it(tmp_path):
    released = released_fixture(tmp_path)
    reference = parse_exercises(nbformat.read(released, as_version=4))
    found = student_code(filled(released, {**RIGHT, "double": "return (2 * x"}), reference)
    assert found.errors[0].startswith("SyntaxError in your answer to exercise 1 (line 3): ")
    assert found.notes[1][0].endswith("; nothing in it is defined")
    assert [c.filename for c in found.cells][0] == "<your answer to exercise 2>"


def test_a_missing_answer_is_named(tmp_path):
    released = released_fixture(tmp_path)
    reference = parse_exercises(nbformat.read(released, as_version=4))
    nb = filled(released, RIGHT)
    del nb.cells[4]
    found = student_code(nb, reference)
    assert found.errors == {1: "no answer: no cell of the notebook defines `square`"}


def test_ipython_syntax_keeps_its_line_numbers():
    source = "x = 1\n%timeit f()\n!ls\ny = 2"
    assert python_source(source).split("\n")[3] == "y = 2"
    assert len(python_source(source).split("\n")) == 4


@pytest.mark.parametrize(
    "cell, lines",
    [
        ("import math\nLIMIT = math.ceil(2.5)\nprint(LIMIT)", [1, 2, 3]),
        ("try:\n    import numpy\nexcept ImportError:\n    pass\ndef f(): pass", [1, 5]),
        # IPython's form of a %%time cell: its body, on the body's own lines
        ("get_ipython().run_cell_magic('time', '', 'def f():\\n    pass\\nf()\\n')", [2, 4]),
        # a cell magic whose body is not Python stays one statement
        ("get_ipython().run_cell_magic('bash', '', 'ls\\n')", [1]),
    ],
)
def test_every_statement_of_a_cell_runs_on_its_own(cell, lines):
    compiled = statements(cell, "<your cell 1>")
    assert [line for line, _ in compiled] == lines


def test_a_time_magic_cell_is_graded_by_its_body():
    source = python_source("%%time\nX = 2\ndef f():\n    return X")
    namespace = {}
    for _, statement in statements(source, "<your cell 1>"):
        exec(statement, namespace)
    assert namespace["f"]() == 2


# ---------------------------------------------------------------------------------------
# Feedback


def run_check(source: str, namespace: dict) -> dict:
    from minillm.course.sandbox import CHECK_HELPERS

    namespace = {**namespace, **CHECK_HELPERS}
    try:
        exec(compile_check(source, "<check of exercise 1>"), namespace)
    except BaseException as exc:
        return describe_failure(exc, {"<check of exercise 1>": source})
    return {}


def test_a_bare_assert_says_both_sides():
    failure = run_check("x = 3\nassert 2 * x == 7", {})
    assert failure["error"] == "AssertionError: 2 * x == 7 is false: 2 * x = 6"
    assert failure["checked"] == "assert 2 * x == 7"
    failure = run_check("items = [1]\nassert len(items) in (0, 2)", {})
    assert failure["error"] == "AssertionError: len(items) in (0, 2) is false: len(items) = 1"
    failure = run_check("assert []", {})
    assert failure["error"] == "AssertionError: [] is false"
    failure = run_check("def ok(x):\n    return x > 1\nassert ok(1)", {})
    assert failure["error"] == "AssertionError: ok(1) is false: it is False"


def test_an_assert_with_a_message_keeps_it_and_each_side_runs_once():
    calls = []
    failure = run_check("assert f() == 2, 'two expected'\n", {"f": lambda: calls.append(1) or 1})
    assert failure["error"] == "AssertionError: two expected"
    assert run_check("assert f() == 1", {"f": lambda: calls.append(1) or 1}) == {}
    assert calls == [1, 1]


def test_hypothesis_failing_input_is_reported():
    check = """
from hypothesis import given, settings, strategies as st

@settings(max_examples=50, derandomize=True, database=None, deadline=None)
@given(st.integers(0, 100), st.sampled_from([4, 8]))
def check(n, bits):
    assert packed(n, bits) == (n * bits + 7) // 8

check()
"""
    failure = run_check(check, {"packed": lambda n, bits: n * bits // 8})
    assert failure["error"].startswith("AssertionError: packed(n, bits) == (n * bits + 7) // 8 is")
    assert failure["input"] == "check(n=1, bits=4)"
    assert failure["checked"] == "assert packed(n, bits) == (n * bits + 7) // 8"


@settings(max_examples=30, derandomize=True, database=None, deadline=None)
@given(st.integers(-50, 50), st.integers(-50, 50))
def test_a_rewritten_assert_decides_as_python_does(a, b):
    for op in ("==", "!=", "<", "<=", ">", ">="):
        source = f"assert a {op} b"
        expected = eval(f"a {op} b", {"a": a, "b": b})
        assert (run_check(source, {"a": a, "b": b}) == {}) is expected
