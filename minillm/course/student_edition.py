"""The student edition: the repository without the answers, for an instructor to publish.

`minillm exercises student-edition OUT` copies the files git tracks into OUT, leaving out

- `solutions/`, the answers with their outputs;
- the tests that read the solutions: the tests of each chapter's checks run the solution
  and plausible wrong answers through them, and a wrong answer one character from the
  right one is an answer.

Then it scans every text file it wrote (the cells and outputs of each notebook, every
other file line by line) for the code of any solution region (`### BEGIN SOLUTION` ...
`### END SOLUTION`) and fails, naming the file and the exercise, if one shows up. OUT is
a plain folder, not a clone: the instructor's history holds `solutions/` in every
commit, so the edition starts a repository of its own (`git init`).

A region is found when a file holds `WINDOW` of its code lines in a row (all of them
when it has fewer), comment and blank lines left out and indentation ignored, and those
lines carry at least `MIN_CHARS` characters (a one-line answer such as `return 2 * x` is
too common to point at an answer), and the file holds at least `MIN_SHARE` of the
region's lines (a run of lines the book teaches, such as the engine's run loop, is not
the answer it sits in).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil
import subprocess

from minillm.course.exercise_model import BEGIN_MARKER, END_MARKER, parse_exercises
from minillm.course.notebook_io import read_notebook

WINDOW = 3
MIN_CHARS = 40
MIN_SHARE = 0.6
SOLUTIONS = "solutions"


@dataclasses.dataclass(frozen=True)
class Region:
    """One solution region: where it is and its code lines, normalized."""

    notebook: str
    cell: int
    exercise: str  # "exercise N (name)" of the answer cell, or "" for another cell
    lines: tuple[str, ...]

    def where(self) -> str:
        return f"{self.notebook}.ipynb, {self.exercise or f'cell {self.cell}'}"

    def windows(self) -> list[tuple[str, ...]]:
        """The runs of lines whose presence in a file reveals this region."""
        if len(self.lines) <= WINDOW:
            runs = [self.lines]
        else:
            runs = [self.lines[i : i + WINDOW] for i in range(len(self.lines) - WINDOW + 1)]
        return [run for run in runs if sum(map(len, run)) >= MIN_CHARS]


def _code_lines(text: str) -> list[str]:
    """Lines of code without indentation, blank lines or comments."""
    return [s for s in (line.strip() for line in text.split("\n")) if s and not s.startswith("#")]


def solution_regions(solutions_dir: pathlib.Path) -> list[Region]:
    """Every solution region of every solution notebook."""
    regions = []
    for path in sorted(solutions_dir.glob("*.ipynb")):
        nb = read_notebook(path)
        try:
            answers = {
                cell: f"exercise {ex.number} ({ex.name})"
                for ex in parse_exercises(nb).exercises
                for cell in ex.answer_cells
            }
        except ValueError:
            answers = {}  # release reports a malformed notebook; its regions still count
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            inside: list[str] | None = None
            for line in cell.source.split("\n"):
                stripped = line.strip()
                if stripped.startswith(BEGIN_MARKER):
                    inside = []
                elif stripped.startswith(END_MARKER) and inside is not None:
                    lines = tuple(_code_lines("\n".join(inside)))
                    regions.append(Region(path.stem, index, answers.get(index, ""), lines))
                    inside = None
                elif inside is not None:
                    inside.append(line)
    return regions


def _texts(path: pathlib.Path) -> list[str]:
    """What a reader of the file sees: a notebook's cell sources and text outputs, or the
    file's text; [] for a binary file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    if path.suffix != ".ipynb":
        return [text]
    try:
        nb = json.loads(text)
    except json.JSONDecodeError:
        return [text]
    texts = []
    for cell in nb.get("cells", []):
        texts.append("".join(cell.get("source", "")))
        for output in cell.get("outputs", []):
            texts.append("".join(output.get("text", "")))
            for value in output.get("data", {}).values():
                if isinstance(value, str | list):
                    texts.append("".join(value))
    return texts


def find_leaks(tree: pathlib.Path, regions: list[Region]) -> list[str]:
    """One line per file of `tree` that holds the code of a solution region."""
    windows = {}
    for region in regions:
        for run in region.windows():
            windows.setdefault(run, region)
    if not windows:
        return []
    leaks = []
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        found = set()
        for text in _texts(path):
            lines = _code_lines(text)
            present = set(lines)
            for size in {len(run) for run in windows}:
                for i in range(len(lines) - size + 1):
                    region = windows.get(tuple(lines[i : i + size]))
                    if region is None:
                        continue
                    # a shared idiom (the engine's run loop) is a run of lines; an answer
                    # is most of the region
                    share = sum(line in present for line in region.lines) / len(region.lines)
                    if share >= MIN_SHARE:
                        found.add(region.where())
        leaks.extend(f"{path.relative_to(tree)}: holds the answer of {w}" for w in sorted(found))
    return leaks


_READS_SOLUTIONS = re.compile(r"""ROOT\s*/\s*["']solutions\b|["']solutions/""")


def reads_solutions(path: pathlib.Path) -> bool:
    """Whether a test file reads the repository's solution notebooks (not a fixture's)."""
    return bool(_READS_SOLUTIONS.search(path.read_text(encoding="utf-8", errors="replace")))


def tracked_files(root: pathlib.Path) -> list[str]:
    """The files git tracks at `root` (the working tree's versions)."""
    result = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ValueError(f"{root} is not a git repository: {result.stderr.strip()}")
    return [name for name in result.stdout.split("\0") if name]


def left_out(root: pathlib.Path, name: str) -> str | None:
    """Why the tracked file `name` stays out of the student edition, or None."""
    if name.split("/", 1)[0] == SOLUTIONS:
        return "a solution"
    path = root / name
    if name.startswith("tests/") and path.suffix == ".py" and reads_solutions(path):
        return "a test that reads the solutions"
    if name.startswith("tests/book/") and path.name == "exercise_checks.py":
        return "runs solutions and wrong answers through the checks"
    return None


ENGINE = ("minillm/", "kernels/")


@dataclasses.dataclass
class Edition:
    """What `write_student_edition` did."""

    left_out: list[str]  # "path (why)"
    leaks: list[str]  # answers found outside the engine: the edition must not be published
    in_engine: list[str]  # answers the engine itself holds: the checks' own oracle


def write_student_edition(root: pathlib.Path, out: pathlib.Path) -> Edition:
    """Write the student edition of the repository at `root` into `out`.

    Answers found in `minillm/` or `kernels/` are reported apart: the book shows that
    code and the checks compare against it, so the edition keeps it.
    """
    root, out = root.resolve(), out.resolve()
    if out == root or root in out.parents:
        raise ValueError(f"{out} is inside the repository {root}: write the edition elsewhere")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: the edition needs a folder of its own")
    names = tracked_files(root)
    skipped = []
    for name in names:
        source = root / name
        if not source.is_file():
            continue  # tracked but deleted in the working tree
        why = left_out(root, name)
        if why:
            skipped.append(f"{name} ({why})")
            continue
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    found = find_leaks(out, solution_regions(root / SOLUTIONS))
    in_engine = [line for line in found if line.startswith(ENGINE)]
    return Edition(skipped, [line for line in found if line not in in_engine], in_engine)
