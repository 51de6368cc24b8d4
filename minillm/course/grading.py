"""Grade exercise notebooks: run each one, score the cells marked `# GRADED: N points`.

A graded cell earns its points when it runs without raising, and none otherwise. Every
notebook runs from top to bottom in a fresh `python3` kernel whose working directory is
the notebook's folder, with a time limit per cell; a cell that raises (or runs out of
time and is interrupted) does not stop the cells after it, so one unfinished exercise
costs only its own points.

    minillm grade exercises/ch00_conventions.ipynb
    minillm grade submissions/ --report grades.csv --timeout 120
    minillm grade submissions/ --reference exercises/

With `--reference`, the checks come from the instructor's copy, not the student's: each
graded cell of the reference notebook (the released exercise of the same file name, when
the reference is a folder) replaces the submission's cell of the same cell id before the
notebook runs, and only the reference's graded cells count, with its points. A student
who edits, deletes or adds a check cell therefore changes nothing but their own code; a
check cell missing from the submission scores zero. When the submission holds none of
the reference's cell ids (a tool rewrote them), graded cells are matched in order, and
both notebooks must have the same number of them. Cell numbers in the report are then
the reference's, so that they line up across students.

A folder stands for every `*.ipynb` below it, in sorted order. A notebook that cannot
run at all (not valid JSON, not a notebook, its kernel died) is reported with the
error and scores zero; grading goes on with the next one. A missing path, or a file
that is not an `.ipynb`, is a one-line error on stderr, and the other paths are still
graded.

The exit status says whether grading worked, not how well the students did: 0 when
every path was found and every notebook ran to the end (whatever the scores), 1
otherwise, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import pathlib
import re
import sys

import nbformat
from nbformat.v4.rwbase import rejoin_lines, strip_transient
from nbformat.validator import iter_validate

GRADED_RE = re.compile(r"^\s*#\s*GRADED:\s*(\d+)\s+points?\s*$", re.MULTILINE)
DEFAULT_TIMEOUT_S = 60
KERNEL_NAME = "python3"


class NotebookReadError(ValueError):
    """A file that is not a readable Jupyter notebook (format 4)."""


@dataclasses.dataclass(slots=True)
class CellGrade:
    """The result of one graded cell (`index` counts every cell of the notebook from 0)."""

    index: int
    max_points: int
    passed: bool
    error: str | None = None  # "ExceptionName: message" when the cell raised

    @property
    def points(self) -> int:
        return self.max_points if self.passed else 0


@dataclasses.dataclass(slots=True)
class NotebookGrade:
    """The graded cells of one notebook; `error` is set when the notebook could not run."""

    path: str
    cells: list[CellGrade]
    error: str | None = None

    @property
    def points(self) -> int:
        return sum(cell.points for cell in self.cells)

    @property
    def max_points(self) -> int:
        return sum(cell.max_points for cell in self.cells)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "points": self.points,
            "max_points": self.max_points,
            "error": self.error,
            "cells": [
                {
                    "cell": c.index,
                    "points": c.points,
                    "max_points": c.max_points,
                    "passed": c.passed,
                    "error": c.error,
                }
                for c in self.cells
            ],
        }


def graded_points(source: str) -> int | None:
    """The points of a cell marked `# GRADED: N points` (or `1 point`), else None."""
    match = GRADED_RE.search(source)
    return int(match.group(1)) if match else None


def read_notebook(path: str | os.PathLike[str]) -> nbformat.NotebookNode:
    """Read and validate a format-4 notebook; NotebookReadError says what is wrong."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NotebookReadError(f"cannot read: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotebookReadError(f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("nbformat") != 4:
        raise NotebookReadError("not a Jupyter notebook (expected a JSON object with nbformat 4)")
    # iter_validate only reads; nbformat.validate would first "repair" the dict, and
    # fails with KeyError or TypeError on some malformed ones.
    for error in iter_validate(data):
        raise NotebookReadError(f"not a valid notebook: {error.message}")
    nb = nbformat.from_dict(data)
    # What nbformat.reads does after parsing: multi-line strings stored as lists are joined.
    return strip_transient(rejoin_lines(nb))


def _error_text(ename: str, evalue: str) -> str:
    first_line = evalue.strip().splitlines()[0] if evalue.strip() else ""
    return f"{ename}: {first_line}" if first_line else ename


def execute_notebook(
    nb: nbformat.NotebookNode, cwd: str | os.PathLike[str], timeout_s: int
) -> dict[int, str | None]:
    """Run every code cell of `nb` in place, in a fresh kernel started in `cwd`.

    Returns, for each cell that ran, None or its error as "ExceptionName: message".
    A cell that runs past `timeout_s` is interrupted and counts as an error. Raises when
    the kernel cannot start or dies (nbclient's exceptions).
    """
    from nbclient import NotebookClient  # imported here: only grading needs a kernel

    errors: dict[int, str | None] = {}

    def on_cell_executed(cell, cell_index: int, execute_reply: dict) -> None:
        content = execute_reply["content"]
        failed = content.get("status") == "error"
        errors[cell_index] = (
            _error_text(content.get("ename", "Error"), content.get("evalue", ""))
            if failed
            else None
        )

    client = NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name=KERNEL_NAME,
        allow_errors=True,
        interrupt_on_timeout=True,
        error_on_timeout={
            "ename": "Timeout",
            "evalue": f"the cell ran longer than {timeout_s} s and was interrupted",
            "traceback": [],
        },
        record_timing=False,
        coalesce_streams=True,  # print() may arrive in pieces; stored outputs must not vary
        resources={"metadata": {"path": str(cwd)}},
        on_cell_executed=on_cell_executed,
    )
    client.execute()
    return errors


def graded_cells(nb: nbformat.NotebookNode) -> dict[int, int]:
    """{cell index: points} for every code cell marked `# GRADED: N points`."""
    return {
        i: points
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (points := graded_points(cell.source)) is not None
    }


def score_cells(nb: nbformat.NotebookNode, errors: dict[int, str | None]) -> list[CellGrade]:
    """Grade the graded cells of `nb` from `execute_notebook`'s per-cell errors."""
    return [
        CellGrade(
            i, points, passed=i in errors and errors[i] is None, error=errors.get(i, "not run")
        )
        for i, points in graded_cells(nb).items()
    ]


def restore_graded_cells(
    submission: nbformat.NotebookNode, reference: nbformat.NotebookNode
) -> dict[int, int | None]:
    """Put the reference's graded cells into `submission`, in place.

    Returns {reference cell index: submission cell index, or None when the submission
    has no such cell}. Cells are matched by id; when no reference graded cell's id occurs
    in the submission, the k-th graded cell of each is matched instead (ValueError if
    their numbers differ). A cell of the submission marked `# GRADED` that the reference
    does not grade loses its marker, so that it cannot earn points.
    """
    wanted = graded_cells(reference)
    by_id = {cell.get("id"): i for i, cell in enumerate(submission.cells)}
    matches = {i: by_id.get(reference.cells[i].get("id")) for i in wanted}
    if wanted and all(j is None for j in matches.values()):
        theirs = list(graded_cells(submission))
        if len(theirs) != len(wanted):
            raise ValueError(
                f"cell ids differ from the reference's and the submission has {len(theirs)} "
                f"graded cells where the reference has {len(wanted)}"
            )
        matches = dict(zip(wanted, theirs, strict=True))
    restored = {j for j in matches.values() if j is not None}
    for i, j in matches.items():
        if j is not None:
            submission.cells[j] = nbformat.v4.new_code_cell(reference.cells[i].source)
            submission.cells[j].id = reference.cells[i].get("id", submission.cells[j].id)
    for j, cell in enumerate(submission.cells):
        if j not in restored and cell.cell_type == "code" and graded_points(cell.source):
            cell.source = GRADED_RE.sub(
                "# (not graded: not a graded cell of the reference)", cell.source
            )
    return matches


def reference_for(path: pathlib.Path, reference: pathlib.Path) -> pathlib.Path:
    """The reference notebook of a submission: `reference` itself, or its namesake inside."""
    return reference / path.name if reference.is_dir() else reference


def grade_notebook(
    path: str | os.PathLike[str],
    timeout_s: int = DEFAULT_TIMEOUT_S,
    reference: str | os.PathLike[str] | None = None,
) -> NotebookGrade:
    """Run the notebook at `path` and score its graded cells.

    With `reference` (a notebook, or a folder holding one of the same file name), the
    graded cells and their points are the reference's (see `restore_graded_cells`).
    A notebook that cannot be read or run gives a NotebookGrade with `error` set; its
    graded cells (when it could be read) are listed as failed.
    """
    path = pathlib.Path(path)
    ref_nb = None
    if reference is not None:
        ref_path = reference_for(path, pathlib.Path(reference))
        try:
            ref_nb = read_notebook(ref_path)
        except NotebookReadError as exc:
            return NotebookGrade(str(path), cells=[], error=f"reference {ref_path}: {exc}")
    try:
        nb = read_notebook(path)
    except NotebookReadError as exc:
        failed = score_reference(ref_nb, {}, {}) if ref_nb is not None else []
        return NotebookGrade(str(path), cells=failed, error=str(exc))
    matches = None
    if ref_nb is not None:
        try:
            matches = restore_graded_cells(nb, ref_nb)
        except ValueError as exc:
            failed = score_reference(ref_nb, {}, {})
            return NotebookGrade(str(path), cells=failed, error=f"cannot grade: {exc}")
    try:
        errors = execute_notebook(nb, path.resolve().parent, timeout_s)
    # A batch of submissions must survive any one of them: the kernel can fail to
    # start, die, or stop answering, and nbclient reports each with its own exception.
    except Exception as exc:
        message = f"did not run: {type(exc).__name__}: {exc}".strip()
        errors, error = {}, message
    else:
        error = None
    if matches is None:
        return NotebookGrade(str(path), cells=score_cells(nb, errors), error=error)
    return NotebookGrade(str(path), cells=score_reference(ref_nb, matches, errors), error=error)


def score_reference(
    reference: nbformat.NotebookNode,
    matches: dict[int, int | None],
    errors: dict[int, str | None],
) -> list[CellGrade]:
    """Grade the reference's graded cells from the errors of their matched submission cells."""
    grades = []
    for i, points in graded_cells(reference).items():
        j = matches.get(i)
        if j is None:
            error = "missing from the submission" if matches else "not run"
        else:
            error = errors.get(j, "not run")
        grades.append(CellGrade(i, points, passed=j is not None and error is None, error=error))
    return grades


def collect_notebooks(paths: list[str]) -> tuple[list[pathlib.Path], list[str]]:
    """Expand folders into their notebooks; returns (notebooks, one error line per bad path)."""
    notebooks: list[pathlib.Path] = []
    problems: list[str] = []
    for name in paths:
        path = pathlib.Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if not found:
                problems.append(f"{name}: folder holds no .ipynb notebooks")
            notebooks.extend(found)
        elif not path.exists():
            problems.append(f"{name}: no such file or folder")
        elif path.suffix != ".ipynb":
            problems.append(f"{name}: not a notebook (expected an .ipynb file or a folder)")
        else:
            notebooks.append(path)
    return notebooks, problems


def _table_rows(grades: list[NotebookGrade]) -> list[tuple[str, str, str, str]]:
    """(notebook, cell, points, result) for each graded cell and each notebook's total."""
    rows = []
    for grade in grades:
        for cell in grade.cells:
            result = "passed" if cell.passed else f"failed: {cell.error}"
            rows.append((grade.path, str(cell.index), f"{cell.points}/{cell.max_points}", result))
        total_result = f"could not run: {grade.error}" if grade.error else ""
        rows.append((grade.path, "total", f"{grade.points}/{grade.max_points}", total_result))
    return rows


def format_table(grades: list[NotebookGrade]) -> str:
    """A plain-text table: one row per graded cell, a total row per notebook."""
    rows = [("notebook", "cell", "points", "result"), *_table_rows(grades)]
    widths = [max(len(row[col]) for row in rows) for col in range(3)]
    lines = [
        f"{path:<{widths[0]}}  {cell:>{widths[1]}}  {points:>{widths[2]}}  {_clip(result)}".rstrip()
        for path, cell, points, result in rows
    ]
    return "\n".join(lines)


def any_clipped(grades: list[NotebookGrade]) -> bool:
    """True when format_table cuts a result short."""
    return any(len(result) > CLIP_WIDTH for *_, result in _table_rows(grades))


CLIP_WIDTH = 100


def _clip(text: str, width: int = CLIP_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def write_report(grades: list[NotebookGrade], report: pathlib.Path) -> None:
    """Write the grades as JSON (`.json`) or CSV (`.csv`, one row per cell plus totals)."""
    if report.suffix == ".json":
        data = {"notebooks": [grade.to_dict() for grade in grades]}
        report.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        return
    if report.suffix != ".csv":
        raise ValueError(f"report must end in .json or .csv, got {report}")
    with report.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "cell", "points", "max_points", "passed", "error"])
        for grade in grades:
            for c in grade.cells:
                writer.writerow(
                    [grade.path, c.index, c.points, c.max_points, c.passed, c.error or ""]
                )
            writer.writerow(
                [grade.path, "total", grade.points, grade.max_points, "", grade.error or ""]
            )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "grade",
        help="run exercise notebooks and score their graded cells",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="notebooks or folders of them")
    parser.add_argument(
        "--report",
        type=pathlib.Path,
        metavar="FILE",
        help="also write the grades to FILE.json or FILE.csv",
    )
    parser.add_argument(
        "--reference",
        type=pathlib.Path,
        metavar="PATH",
        help="take the graded cells and points from this notebook, or from the notebook "
        "of the same name in this folder (e.g. exercises/)",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time limit per cell (default {DEFAULT_TIMEOUT_S})",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.report is not None and args.report.suffix not in (".json", ".csv"):
        print(
            f"minillm grade: --report must end in .json or .csv, got {args.report}", file=sys.stderr
        )
        return 2
    if args.timeout <= 0:
        print(f"minillm grade: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    if args.reference is not None and not args.reference.exists():
        print(
            f"minillm grade: --reference {args.reference}: no such file or folder", file=sys.stderr
        )
        return 2
    notebooks, problems = collect_notebooks(args.paths)
    for problem in problems:
        print(f"minillm grade: {problem}", file=sys.stderr)
    grades = [grade_notebook(path, args.timeout, args.reference) for path in notebooks]
    if grades:
        print(format_table(grades))
        if any_clipped(grades) and args.report is None:
            print(
                "minillm grade: messages ending in ... are cut; "
                "--report FILE.json keeps them whole",
                file=sys.stderr,
            )
    if args.report is not None:
        write_report(grades, args.report)
    ok = not problems and all(grade.error is None for grade in grades)
    return 0 if ok else 1
