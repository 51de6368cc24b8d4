"""A class's private variant: checks that draw their worked examples from a class seed.

The fixture exercise asks for `kv_bytes(num_tokens)`, 128 bytes a token. Its check's worked
example is 1000 tokens in the public edition, so an answer that returns the public
expected value, 128000, passes there; in a class's variant the example is drawn from the
class seed and that answer fails.
"""

from __future__ import annotations

import csv
import pathlib
import subprocess
import sys

import nbformat
import pytest

from minillm.cli.main import main
from minillm.course import variants
from minillm.course.exercise_model import parse_exercises
from minillm.course.exercises import (
    class_example_checks,
    release,
    release_variant,
    variant_checks,
    variant_exercise,
)

from .conftest import REPO_URL, code, filled, md, notebook, write_notebook

CELLS = [
    md("# A variant fixture"),
    md("## Exercise 1: KV bytes (2 points)"),
    code(
        "def kv_bytes(num_tokens):\n    ### BEGIN SOLUTION\n    return 128 * num_tokens\n"
        "    ### END SOLUTION",
        "kv_bytes",
    ),
    code(
        "# GRADED: 2 points\n"
        "from minillm.course.variants import variant\n\n"
        'num_tokens = variant("num_tokens", 1000, lambda rng: rng.randrange(8, 4096))\n'
        "assert kv_bytes(num_tokens) == 128 * num_tokens",
        "kv_bytes-check",
    ),
]
RIGHT = {"kv_bytes": "return 128 * num_tokens"}
COPIED = {"kv_bytes": "return 128000"}  # the public example's expected value, typed in


def in_cell(seed, name, public, draw):
    """What `variant` returns in a cell that defines CLASS_SEED = seed (None: none)."""
    namespace = {"variant": variants.variant, "draw": draw}
    if seed is not None:
        namespace["CLASS_SEED"] = seed
    exec(f"value = variant({name!r}, {public!r}, draw)", namespace)
    return namespace["value"]


def draw(rng):
    return rng.randrange(8, 4096)


def test_without_a_class_seed_the_public_value_is_used():
    assert in_cell(None, "n", 1000, draw) == 1000
    assert variants.variant("n", 1000, draw) == 1000  # this module defines no CLASS_SEED


def test_a_class_seed_draws_the_same_value_every_time_and_another_per_class_and_name():
    fall = in_cell("fall", "n", 1000, draw)
    assert in_cell("fall", "n", 1000, draw) == fall != 1000
    names = {in_cell("fall", f"n{i}", 1000, draw) for i in range(20)}
    classes = {in_cell(seed, "n", 1000, draw) for seed in range(20)}
    assert len(names) > 15 and len(classes) > 15  # 4088 values: collisions are rare


def test_a_draw_never_returns_the_public_value():
    # two values: half the draws give the public one, and are drawn again
    assert {in_cell("spring", f"v{i}", 0, lambda rng: rng.randrange(2)) for i in range(50)} == {1}
    with pytest.raises(ValueError, match="gave its public value 7"):
        in_cell("spring", "v", 7, lambda rng: 7)


def test_bad_names_and_seeds_are_refused():
    with pytest.raises(ValueError, match="needs a name"):
        in_cell("fall", "", 1, draw)
    with pytest.raises(ValueError, match="non-empty"):
        in_cell("  ", "n", 1, draw)


def test_the_variant_seeds_each_check_and_keeps_statement_and_starter(tmp_path):
    write_notebook(tmp_path / "solutions" / "ex.ipynb", notebook(CELLS))
    release(tmp_path / "solutions", tmp_path / "exercises", REPO_URL)
    public = (tmp_path / "exercises" / "ex.ipynb").read_text()
    private = nbformat.reads(variant_exercise(public, "fall-27"), as_version=4)
    check = private.cells[4].source
    assert check.split("\n")[:2] == [
        "# GRADED: 2 points",
        "CLASS_SEED = 'fall-27'  # this class's values: see minillm.course.variants",
    ]
    assert check.endswith(CELLS[3].source.split("\n", 1)[1])
    # the versions grading compares: a submission from the public edition is current
    old = parse_exercises(nbformat.reads(public, as_version=4)).exercises
    new = parse_exercises(private).exercises
    assert [e.version for e in new] == [e.version for e in old]
    assert [e.points for e in new] == [2]
    with pytest.raises(ValueError, match="must not be empty"):
        variant_exercise(public, "")


def test_variant_checks_counts_the_checks_that_call_variant():
    fixed = code("# GRADED: 1 point\nassert kv_bytes(2) == 256", "other-check")
    nb = notebook([*CELLS, fixed, code("x = variant('a', 1, draw)")])  # not a check
    assert variant_checks(nb) == (1, 2)
    stateful = code("# GRADED: 1 point\nfrom hypothesis.stateful import invariant", "s-check")
    assert variant_checks(notebook([stateful])) == (0, 1)  # invariant( is not variant(


def test_class_example_checks_counts_the_checks_whose_hypothesis_tests_are_marked():
    marked = code("# GRADED: 1 point\n@class_examples\n@settings()\ndef check(): ...", "m-check")
    unmarked = code("# GRADED: 1 point\n@settings()\ndef check(): ...", "u-check")
    setup = code("@class_examples\ndef helper(): ...")  # not a check
    assert class_example_checks(notebook([*CELLS, marked, unmarked, setup])) == 1


# the grader runs checks in `python -I`, which imports the installed minillm, not PYTHONPATH's
GRADER_HAS_VARIANTS = (
    subprocess.run(
        [sys.executable, "-I", "-c", "import minillm.course.variants"], capture_output=True
    ).returncode
    == 0
)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """A class folder graded by the command line against the public exercises and against
    a class's variant: {reference: {student: points}} from each run's CSV table."""
    root = tmp_path_factory.mktemp("variant")
    write_notebook(root / "solutions" / "ex.ipynb", notebook(CELLS))
    release(root / "solutions", root / "exercises", REPO_URL)
    release_variant(root / "solutions", root / "private", REPO_URL, "fall-27")
    released = root / "exercises" / "ex.ipynb"
    write_notebook(root / "class" / "alice.ipynb", filled(released, RIGHT))
    write_notebook(root / "class" / "bob.ipynb", filled(released, COPIED))
    write_notebook(root / "class" / "carol.ipynb", filled(released, {}))
    result = {}
    for reference in ("exercises", "private"):
        report = root / f"{reference}.csv"
        argv = ["grade", str(root / "class"), "--reference", str(root / reference), "-j", "2"]
        assert main([*argv, "--report", str(report)]) == 0
        with report.open(newline="") as f:
            result[reference] = {r["student"]: r["points"] for r in csv.DictReader(f)}
    return result


@pytest.mark.skipif(
    not GRADER_HAS_VARIANTS,
    reason="the installed minillm, which grading imports, predates variants",
)
def test_the_public_value_passes_the_public_check_and_fails_the_variant(graded):
    assert graded["exercises"] == {"alice": "2", "bob": "2", "carol": "0"}
    assert graded["private"] == {"alice": "2", "bob": "0", "carol": "0"}


def _git(root: pathlib.Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_cli_writes_the_variant_only_where_git_would_not_commit_it(tmp_path, capsys):
    repo = tmp_path / "repo"
    write_notebook(repo / "solutions" / "ex.ipynb", notebook(CELLS))
    (repo / "_config.yml").write_text(f"repository:\n  url: {REPO_URL}\n", encoding="utf-8")
    (repo / ".gitignore").write_text("private/\n", encoding="utf-8")
    _git(repo, "init", "-q")
    folders = [f"--solutions={repo / 'solutions'}", f"--config={repo / '_config.yml'}"]
    folders.append(f"--exercises={repo / 'exercises'}")

    assert main(["exercises", "release", "--seed", "s", *folders]) == 1
    assert "--seed and --out go together" in capsys.readouterr().err

    tracked = repo / "variants"
    assert main(["exercises", "release", "--seed", "s", "--out", str(tracked), *folders]) == 1
    assert "not ignored by git" in capsys.readouterr().err and not tracked.exists()

    for out in (repo / "private" / "fall", tmp_path / "elsewhere"):
        assert main(["exercises", "release", "--seed", "s", "--out", str(out), *folders]) == 0
        assert "ex.ipynb: 1 of 1 checks draw this class's values" in capsys.readouterr().out
        assert "CLASS_SEED = 's'" in (out / "ex.ipynb").read_text()
        assert (out / "conftest.py").exists()
    assert not (repo / "exercises").exists()  # the public release is left alone


CHECK = """
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.course.variants import class_examples

seen = []


@class_examples
@settings(max_examples=10, derandomize=True, database=None, deadline=None)
@given(st.integers(0, 10**9))
def check(n):
    seen.append(n)


check()
"""


def examples(seed) -> list[int]:
    """The examples a Hypothesis check marked `class_examples` is given in a cell that
    defines CLASS_SEED = seed (None: the public edition)."""
    namespace = {} if seed is None else {"CLASS_SEED": seed}
    exec(CHECK, namespace)
    return namespace["seen"]


def test_class_examples_keeps_the_public_examples_and_draws_each_class_its_own():
    public = examples(None)
    assert examples(None) == public  # derandomized: the same questions on every run
    fall = examples("fall")
    assert examples("fall") == fall  # a class's examples are the same on every run
    assert fall != public
    assert examples("spring") not in (fall, public)


def test_class_examples_refuses_an_empty_seed():
    with pytest.raises(ValueError, match="non-empty"):
        examples(" ")
