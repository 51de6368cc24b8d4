"""Fixture notebooks for the exercise tooling, built in code so each test shows its input.

`SOLUTION_CELLS` is a small exercise notebook with three exercises, `double`, `square` and
`mean` (2 + 1 + 3 points), after the bootstrap cell: their answer cells sit at indices 2, 4
and 6, their graded cells at 3, 5 and 7, with the ids release requires (`double`,
`double-check`, ...).
"""

from __future__ import annotations

import dataclasses
import pathlib

import nbformat
import pytest

from minillm.course.bootstrap import bootstrap_cell

REPO_URL = "https://example.org/fixture/minillm"

md = nbformat.v4.new_markdown_cell


def code(source: str, cell_id: str | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    if cell_id is not None:
        cell.id = cell_id
    return cell


SOLUTION_CELLS = [
    md("# A fixture exercise"),
    code(
        "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION", "double"
    ),
    code("# GRADED: 2 points\nassert double(3) == 6\nassert double(-1) == -2", "double-check"),
    code(
        "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION", "square"
    ),
    code("# GRADED: 1 point\nassert square(4) == 16\nassert square(-3) == 9", "square-check"),
    code(
        "def mean(xs):\n    ### BEGIN SOLUTION\n    return sum(xs) / len(xs)\n    ### END SOLUTION",
        "mean",
    ),
    code("# GRADED: 3 points\nassert mean([1, 2, 3, 6]) == 3\nassert mean([5]) == 5", "mean-check"),
]
GRADED_POINTS = {3: 2, 5: 1, 7: 3}
POINTS = {"double": 2, "square": 1, "mean": 3}


def notebook(cells: list, bootstrap: bool = True) -> nbformat.NotebookNode:
    """A notebook of copies of `cells`, after the fixture's bootstrap cell by default."""
    cells = [nbformat.from_dict(dict(cell)) for cell in cells]
    first = bootstrap_cell(REPO_URL)
    first.id = "bootstrap"
    nb = nbformat.v4.new_notebook(cells=([first] if bootstrap else []) + cells)
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}
    }
    return nb


def replace_source(nb: nbformat.NotebookNode, index: int, old: str, new: str) -> None:
    assert old in nb.cells[index].source
    nb.cells[index].source = nb.cells[index].source.replace(old, new)


def write_notebook(path: pathlib.Path, nb: nbformat.NotebookNode) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nbformat.writes(nb), encoding="utf-8")
    return path


@dataclasses.dataclass
class Project:
    """A repository-shaped folder: _config.yml, solutions/, exercises/ (not yet created)."""

    root: pathlib.Path

    @property
    def solutions(self) -> pathlib.Path:
        return self.root / "solutions"

    @property
    def exercises(self) -> pathlib.Path:
        return self.root / "exercises"

    @property
    def config(self) -> pathlib.Path:
        return self.root / "_config.yml"

    def cli_folders(self) -> list[str]:
        return [
            f"--solutions={self.solutions}",
            f"--exercises={self.exercises}",
            f"--config={self.config}",
        ]


@pytest.fixture
def project(tmp_path: pathlib.Path) -> Project:
    (tmp_path / "_config.yml").write_text(
        f"title: fixture\nrepository:\n  url: {REPO_URL}\n  branch: main\n", encoding="utf-8"
    )
    (tmp_path / "solutions").mkdir()
    return Project(tmp_path)


STUB = 'raise NotImplementedError("replace this line with your solution")'


def released_fixture(folder: pathlib.Path, cells: list | None = None) -> pathlib.Path:
    """Release a solution notebook of `cells` (default SOLUTION_CELLS) into `folder`.

    Returns the released exercise, `folder/exercises/ex.ipynb`; the solution is
    `folder/solutions/ex.ipynb`.
    """
    from minillm.course.exercises import release

    write_notebook(folder / "solutions" / "ex.ipynb", notebook(cells or SOLUTION_CELLS))
    release(folder / "solutions", folder / "exercises", REPO_URL)
    return folder / "exercises" / "ex.ipynb"


def filled(released: pathlib.Path, answers: dict[str, str]) -> nbformat.NotebookNode:
    """The released notebook with the stub of the answer cell `name` replaced by answers[name]."""
    nb = nbformat.read(released, as_version=4)
    for name, answer in answers.items():
        [cell] = [c for c in nb.cells if c.get("id") == name]
        assert STUB in cell.source, name
        cell.source = cell.source.replace(STUB, answer.replace("\n", "\n    "))
    return nb


RIGHT = {"double": "return 2 * x", "square": "return x * x", "mean": "return sum(xs) / len(xs)"}
