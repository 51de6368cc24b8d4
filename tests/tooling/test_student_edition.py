"""`minillm exercises student-edition OUT`: the repository without its answers."""

from __future__ import annotations

import json
import pathlib
import subprocess

import nbformat
import pytest

from minillm.cli.main import main
from minillm.course.exercises import release
from minillm.course.student_edition import find_leaks, solution_regions, write_student_edition

from .conftest import REPO_URL, SOLUTION_CELLS, code, md, notebook, write_notebook

ROOT = pathlib.Path(__file__).resolve().parents[2]

# an answer long enough to point at: four lines, none of them a common idiom alone
LONG_ANSWER = [
    "fewest = min(outstanding.get(c, 0) for c in candidates)",
    "for step in range(len(candidates)):",
    "    c = candidates[(turn + step) % len(candidates)]",
    "    if outstanding.get(c, 0) == fewest:",
    "        return c",
]
CELLS = [
    *SOLUTION_CELLS,
    md("## Exercise 4: pick (2 points)"),
    code(
        "def pick(candidates, outstanding, turn):\n    ### BEGIN SOLUTION\n"
        + "\n".join("    " + line for line in LONG_ANSWER)
        + "\n    ### END SOLUTION",
        "pick",
    ),
    code("# GRADED: 2 points\nassert pick(['a', 'b'], {'a': 1}, 0) == 'b'", "pick-check"),
]
CHAPTER_TEST = 'SOLUTION = ROOT / "solutions" / "ch01_ex.ipynb"\nWRONG = "return 3 * x"\n'


def _git(root: pathlib.Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: pathlib.Path) -> pathlib.Path:
    """A repository with a solution, its exercise, a chapter test that reads the solution,
    a test that does not, and a book page."""
    root = tmp_path / "repo"
    write_notebook(root / "solutions" / "ch01_ex.ipynb", notebook(CELLS))
    release(root / "solutions", root / "exercises", REPO_URL)
    (root / "tests" / "book").mkdir(parents=True)
    (root / "tests" / "book" / "test_ch01_ex.py").write_text(CHAPTER_TEST)
    (root / "tests" / "test_engine.py").write_text("def test_x():\n    assert 1 + 1 == 2\n")
    (root / "book").mkdir()
    (root / "book" / "01_page.md").write_text("# A page\n\nWe pick a replica.\n")
    (root / "pyproject.toml").write_text("[project]\nname = 'fixture'\n")
    (root / "notes.txt").write_text("left untracked: not part of the edition\n")
    _git(root, "init", "-q")
    _git(root, "add", "solutions", "exercises", "tests", "book", "pyproject.toml")
    return root


def test_the_edition_leaves_out_solutions_and_the_tests_that_read_them(repo, tmp_path):
    out = tmp_path / "edition"
    edition = write_student_edition(repo, out)
    assert edition.leaks == [] and edition.in_engine == []
    assert sorted(edition.left_out) == [
        "solutions/ch01_ex.ipynb (a solution)",
        "tests/book/test_ch01_ex.py (a test that reads the solutions)",
    ]
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == [
        "book/01_page.md",
        "exercises/ch01_ex.ipynb",
        "exercises/conftest.py",
        "pyproject.toml",
        "tests/test_engine.py",
    ]
    assert (out / "exercises" / "ch01_ex.ipynb").read_bytes() == (
        repo / "exercises" / "ch01_ex.ipynb"
    ).read_bytes()


def test_an_answer_quoted_in_a_page_or_a_notebook_output_is_found(repo, tmp_path):
    indented = "\n".join("    " + line for line in LONG_ANSWER)
    (repo / "book" / "01_page.md").write_text(f"```python\ndef pick(c, o, t):\n{indented}\n```\n")
    nb = notebook([code("print('hi')")])
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=indented)]
    write_notebook(repo / "book" / "02_page.ipynb", nb)
    _git(repo, "add", "book")
    edition = write_student_edition(repo, tmp_path / "edition")
    assert edition.leaks == [
        "book/01_page.md: holds the answer of ch01_ex.ipynb, exercise 4 (pick)",
        "book/02_page.ipynb: holds the answer of ch01_ex.ipynb, exercise 4 (pick)",
    ]


def test_the_engine_holding_an_answer_is_reported_apart(repo, tmp_path):
    engine = repo / "minillm" / "serve" / "router.py"
    engine.parent.mkdir(parents=True)
    body = "\n".join("    " + line for line in LONG_ANSWER)
    engine.write_text(f"def pick_least_outstanding(candidates, outstanding, turn):\n{body}\n")
    _git(repo, "add", "minillm")
    edition = write_student_edition(repo, tmp_path / "edition")
    assert edition.leaks == []
    assert edition.in_engine == [
        "minillm/serve/router.py: holds the answer of ch01_ex.ipynb, exercise 4 (pick)"
    ]


def test_short_answers_and_shared_idioms_are_not_answers(tmp_path):
    solutions = tmp_path / "solutions"
    loop = [
        "engine = make_engine(num_blocks)",
        "while engine.has_unfinished_requests():",
        "    for output in engine.step():",
        "        if output.finished:",
        "            outputs[output.request_id] = output.outputs[0].token_ids",
        "ideal = sum(len(p) + PARAMS.max_tokens - 1 for p in PROMPTS)",
        "total = sum(engine.stats.num_batched_tokens) - ideal",
        "return engine.stats.num_preemptions, total, outputs",
    ]
    source = "def run():\n    ### BEGIN SOLUTION\n" + "\n".join("    " + x for x in loop)
    write_notebook(
        solutions / "ch03.ipynb",
        notebook([code(source + "\n    ### END SOLUTION"), *SOLUTION_CELLS]),
    )
    regions = solution_regions(solutions)
    # the fixture's one-line answers (return 2 * x ...) are too short to point at an answer
    assert [len(r.windows()) > 0 for r in regions] == [True, False, False, False]
    page = tmp_path / "book" / "page.md"
    page.parent.mkdir()
    # the engine's run loop, as a chapter teaches it: three of the answer's eight lines
    page.write_text("\n".join(loop[1:4]) + "\nreturn 2 * x\n")
    assert find_leaks(page.parent, regions) == []
    page.write_text("\n".join(loop[:6]))  # most of the answer
    assert find_leaks(page.parent, regions) == [
        "page.md: holds the answer of ch03.ipynb, exercise 1 (run)"
    ]


def test_the_edition_refuses_a_folder_inside_the_repository_or_not_empty(repo, tmp_path):
    with pytest.raises(ValueError, match="inside the repository"):
        write_student_edition(repo, repo / "edition")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        write_student_edition(repo, tmp_path / "full")


def test_cli_exits_1_and_says_not_to_publish_when_an_answer_shows(
    repo, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(repo)
    assert main(["exercises", "student-edition", str(tmp_path / "clean")]) == 0
    assert "git init" in capsys.readouterr().out
    indented = "\n".join("    " + line for line in LONG_ANSWER)
    (repo / "book" / "01_page.md").write_text(f"```python\n{indented}\n```\n")
    assert main(["exercises", "student-edition", str(tmp_path / "leaky")]) == 1
    err = capsys.readouterr().err
    assert "answer found: book/01_page.md" in err and "do not publish it" in err


def test_the_repository_s_edition_shows_no_answer_outside_the_engine(tmp_path):
    out = tmp_path / "edition"
    edition = write_student_edition(ROOT, out)
    assert edition.leaks == []
    assert all(line.startswith(("minillm/", "kernels/")) for line in edition.in_engine)
    assert not (out / "solutions").exists()
    assert not list((out / "tests" / "book").glob("test_ch[0-9][0-9]_*.py"))
    exercises = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
    assert sorted(p.name for p in (out / "exercises").glob("*.ipynb")) == exercises
    # the pages that read the solutions when they exist still have what they need
    assert json.loads((out / "book" / "data" / "solution_times.json").read_text())["notebooks"]
