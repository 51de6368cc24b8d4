"""Fixture notebooks for the exercise tooling, built in code so each test shows its input.

`SOLUTION_CELLS` is a small exercise with three graded cells (2 + 1 + 3 points) after
the bootstrap cell: the graded cells sit at indices 3, 5 and 7.
"""

from __future__ import annotations

import dataclasses
import pathlib

import nbformat
import pytest

from minillm.course.bootstrap import bootstrap_cell

REPO_URL = "https://example.org/fixture/minillm"

md = nbformat.v4.new_markdown_cell
code = nbformat.v4.new_code_cell

SOLUTION_CELLS = [
    md("# A fixture exercise"),
    code("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"),
    code("# GRADED: 2 points\nassert double(3) == 6\nassert double(-1) == -2"),
    code("def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
    code("# GRADED: 1 point\nassert square(4) == 16\nassert square(-3) == 9"),
    code(
        "def mean(xs):\n    ### BEGIN SOLUTION\n    return sum(xs) / len(xs)\n    ### END SOLUTION"
    ),
    code("# GRADED: 3 points\nassert mean([1, 2, 3, 6]) == 3\nassert mean([5]) == 5"),
]
GRADED_POINTS = {3: 2, 5: 1, 7: 3}


def notebook(cells: list, bootstrap: bool = True) -> nbformat.NotebookNode:
    """A notebook of copies of `cells`, after the fixture's bootstrap cell by default."""
    cells = [nbformat.from_dict(dict(cell)) for cell in cells]
    nb = nbformat.v4.new_notebook(cells=([bootstrap_cell(REPO_URL)] if bootstrap else []) + cells)
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
