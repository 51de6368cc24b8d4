"""What an exercise notebook is made of, and which cells of a submission are the student's.

A notebook (a solution, its released exercise, or a student's filled-in copy) is read as
a sequence of steps:

- the bootstrap cell (skipped: grading never installs anything);
- setup cells: code the author wrote, which the checks rely on;
- answer cells: the code cells the student fills in. In a solution they hold
  `### BEGIN SOLUTION` ... `### END SOLUTION`; in the released exercise the stub
  (`raise NotImplementedError(...)`); in a filled-in copy they are found by their cell
  id or by the functions they define, both recorded in the notebook's metadata;
- check cells, marked `# GRADED: N points`.

Exercise k is the k-th check cell together with the answer cells since the check before
it. Its *name* is the function (or class) the student writes: the first top-level
definition of its first answer cell that holds a stub. The name never depends on the
position of the exercise, so it identifies the exercise across releases, and the cell
ids derive from it: the answer cell is `<name>` (then `<name>-2`, ...), the check cell
`<name>-check`. Release copies these ids and records each exercise (its number, name,
points, the functions it asks for, its starter code and a version hash of its statement
and starter code) in the notebook metadata under `minillm`.

The *starter* of an answer cell is the cell as released: the author's code with each
solution region replaced by the stub. Grading runs the starters (never the student's
version of them), so that what the author's code defines in an answer cell, such as a
data table the check compares against, comes from the reference.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import re

import nbformat

from minillm.course.bootstrap import looks_like_bootstrap_cell
from minillm.course.notebook_io import graded_points

BEGIN_MARKER = "### BEGIN SOLUTION"
END_MARKER = "### END SOLUTION"
STUB_RAISE = 'raise NotImplementedError("replace this line with your solution")'
STUB_LINES = ("# YOUR CODE HERE", STUB_RAISE)
METADATA_KEY = "minillm"
TIMING_TAG = "timing"  # a check cell with this tag runs alone when grading in parallel
NETWORK_TAG = "network"  # a check cell with this tag may open TCP sockets (collectives on loopback)
# a check cell with this tag runs in the student's process: the student's code must work on
# the live objects the check builds (trace an engine's operations, say), which a copy or a
# reference from another process cannot stand for
STUDENT_PROCESS_TAG = "student-process"

_HEADING = re.compile(r"^#+\s*Exercise\s+(\d+)\s*[:.]?\s*(.*?)\s*(?:\(\d+\s+points?\))?\s*$")
_HEADING_NUMBER = re.compile(r"\bExercise\s+\d+")
_CELL_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def strip_solutions(source: str) -> str:
    """Replace each solution region of a code cell's source by the stub lines.

    Raises ValueError naming the line of an unbalanced or nested marker.
    """
    out: list[str] = []
    begin_line: int | None = None
    for lineno, line in enumerate(source.split("\n"), start=1):
        stripped = line.strip()
        if stripped.startswith(BEGIN_MARKER):
            if begin_line is not None:
                raise ValueError(
                    f"line {lineno}: {BEGIN_MARKER} inside the region opened at line "
                    f"{begin_line} (regions cannot nest)"
                )
            begin_line = lineno
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(indent + stub for stub in STUB_LINES)
        elif stripped.startswith(END_MARKER):
            if begin_line is None:
                raise ValueError(f"line {lineno}: {END_MARKER} without a {BEGIN_MARKER} before it")
            begin_line = None
        elif begin_line is None:
            out.append(line)
    if begin_line is not None:
        raise ValueError(f"line {begin_line}: {BEGIN_MARKER} is never closed by {END_MARKER}")
    return "\n".join(out)


def has_marker(source: str) -> bool:
    return any(line.strip().startswith((BEGIN_MARKER, END_MARKER)) for line in source.split("\n"))


def python_source(source: str) -> str:
    """A cell's source as plain Python, line for line.

    IPython syntax (`%magic`, `!command`) becomes the `get_ipython()` calls IPython runs;
    without IPython those lines become comments. Either way a line keeps its number.
    """
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return "\n".join(
            "#" + line if line.lstrip().startswith(("%", "!")) else line
            for line in source.split("\n")
        )
    transformed = TransformerManager().transform_cell(source)
    if transformed.endswith("\n") and not source.endswith("\n"):
        transformed = transformed[:-1]  # transform_cell ends every cell with a newline
    return transformed


def top_level_definitions(source: str) -> list[tuple[str, str]]:
    """(name, source segment) of each top-level def and class; [] if the code does not parse."""
    code = python_source(source)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    return [
        (node.name, ast.get_source_segment(code, node) or "")
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]


def stub_functions(starter: str) -> list[str]:
    """The top-level definitions of a starter that hold a stub: what the student writes."""
    return [name for name, segment in top_level_definitions(starter) if STUB_RAISE in segment]


@dataclasses.dataclass(frozen=True, slots=True)
class Exercise:
    """One exercise of a notebook: its answer cells and the check that grades them."""

    number: int  # 1-based: the k-th graded cell of the notebook
    name: str  # the function or class the student writes; stable across releases
    title: str  # from the heading "## Exercise N: title (P points)", or ""
    points: int
    functions: tuple[str, ...]  # every definition the student writes in its answer cells
    answer_ids: tuple[str, ...]  # cell ids of its answer cells, in the reference
    answer_cells: tuple[int, ...]  # their indices
    starters: tuple[str, ...]  # those cells as released
    check_id: str
    check_cell: int
    check_source: str
    statement: str  # the markdown cells from its heading to its check, joined ("": no heading)
    timing: bool  # the check measures time: it runs alone
    network: bool = False  # the check starts processes that talk over TCP (torch.distributed)
    student_process: bool = False  # the check runs in the student's process (see the tag)

    @property
    def label(self) -> str:
        return f"exercise {self.number}"

    @property
    def version(self) -> str:
        """A hash of what the student sees: the statement and the starter code.

        The exercise's number is left out, so that inserting an exercise before it changes
        the version of none of those after it.
        """
        statement = _HEADING_NUMBER.sub("Exercise", self.statement)
        text = "\n\0".join((statement, *self.starters))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]

    def expected_ids(self) -> tuple[tuple[str, ...], str]:
        """The cell ids release gives its answer cells and its check cell."""
        answers = tuple(
            self.name if i == 0 else f"{self.name}-{i + 1}" for i in range(len(self.answer_ids))
        )
        return answers, f"{self.name}-check"


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """A code cell of the reference as grading runs it: setup (or a starter), or a check."""

    kind: str  # "setup" or "check"
    index: int  # the cell's index in the notebook
    source: str  # plain Python (see python_source)
    exercise: int | None = None  # for a check: its index into ExerciseSet.exercises


@dataclasses.dataclass(frozen=True, slots=True)
class ExerciseSet:
    """A notebook read as a reference: its exercises and the code the checks run after."""

    exercises: tuple[Exercise, ...]
    steps: tuple[Step, ...]
    setup_ids: frozenset[str]  # ids of the cells that are the author's code (not answers)
    setup_sources: frozenset[str]

    def functions(self) -> dict[str, int]:
        """{function name: index of the exercise that asks for it}."""
        return {f: k for k, ex in enumerate(self.exercises) for f in ex.functions}

    def metadata(self, notebook_name: str) -> dict:
        """What release records under the notebook metadata's `minillm` key."""
        return {
            "notebook": notebook_name,
            "exercises": [
                {
                    "number": ex.number,
                    "name": ex.name,
                    "points": ex.points,
                    "version": ex.version,
                    "functions": list(ex.functions),
                    "answer_cells": dict(zip(ex.answer_ids, ex.starters, strict=True)),
                }
                for ex in self.exercises
            ],
        }


def recorded_exercises(nb: nbformat.NotebookNode) -> list[dict]:
    """The exercises release recorded in the notebook's metadata ([] when there are none)."""
    meta = nb.metadata.get(METADATA_KEY)
    exercises = meta.get("exercises") if isinstance(meta, dict) else None
    if not isinstance(exercises, list):
        return []
    return [e for e in exercises if isinstance(e, dict) and isinstance(e.get("name"), str)]


def _heading(source: str) -> tuple[int, str] | None:
    for line in source.split("\n"):
        match = _HEADING.match(line.strip())
        if match:
            return int(match.group(1)), match.group(2)
    return None


def bootstrap_index(nb) -> int | None:
    """The index of the bootstrap cell: the first code cell, when it is one (an exercise's
    title comes before it, a solution's after it); None without one."""
    first = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), None)
    if first is not None and looks_like_bootstrap_cell(nb.cells[first]):
        return first
    return None


def parse_exercises(nb: nbformat.NotebookNode) -> ExerciseSet:
    """Read `nb` as a reference. Raises ValueError ("cell N: ...") for a malformed notebook."""
    recorded = recorded_exercises(nb)
    recorded_starters = {
        cell_id: starter
        for e in recorded
        for cell_id, starter in (e.get("answer_cells") or {}).items()
        if isinstance(starter, str)
    }
    recorded_functions = {f for e in recorded for f in e.get("functions", []) if isinstance(f, str)}
    has_stubs = any(
        c.cell_type == "code" and (has_marker(c.source) or STUB_RAISE in c.source) for c in nb.cells
    )

    def starter_of(index: int, cell: nbformat.NotebookNode) -> str | None:
        """The starter of an answer cell, or None for a setup cell."""
        source = cell.source
        if has_marker(source):
            try:
                return strip_solutions(source)
            except ValueError as exc:
                raise ValueError(f"cell {index}: {exc}") from None
        if STUB_RAISE in source:
            return source
        if cell.get("id") in recorded_starters:
            return recorded_starters[cell.get("id")]
        defined = {name for name, _ in top_level_definitions(source)}
        if defined & recorded_functions:
            starters = [s for s in recorded_starters.values() if defined & set(stub_functions(s))]
            return starters[0] if starters else _without_definitions(source)
        if not has_stubs and not recorded and defined:
            # a filled-in notebook with nothing recorded: a cell that defines something
            # before a check is taken for an answer; its other statements still run
            return _without_definitions(source)
        return None

    exercises: list[Exercise] = []
    steps: list[Step] = []
    setup_ids: set[str] = set()
    setup_sources: set[str] = set()
    # (cell index, cell id, starter, functions) of the answer cells since the last check
    pending: list[tuple[int, str, str, list[str]]] = []
    statement: list[str] = []
    heading: tuple[int, str] | None = None
    bootstrap = bootstrap_index(nb)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            if _heading(cell.source):
                heading, statement = _heading(cell.source), []
            if heading is not None:
                statement.append(cell.source)
            continue
        if cell.cell_type != "code" or index == bootstrap:
            continue
        points = graded_points(cell.source)
        if points is not None:
            number = len(exercises) + 1
            if heading is not None and heading[0] != number:
                raise ValueError(
                    f"cell {index}: graded cell {number} sits under the heading of exercise "
                    f"{heading[0]}: each exercise needs its own '## Exercise N: ...' heading"
                )
            functions = [f for *_, fs in pending for f in fs]
            name = functions[0] if functions else _name_from_check_id(cell.get("id"), number)
            exercises.append(
                Exercise(
                    number=number,
                    name=name,
                    title=heading[1] if heading else "",
                    points=points,
                    functions=tuple(dict.fromkeys(functions)),
                    answer_ids=tuple(cell_id for _, cell_id, _, _ in pending),
                    answer_cells=tuple(i for i, *_ in pending),
                    starters=tuple(starter for _, _, starter, _ in pending),
                    check_id=cell.get("id", ""),
                    check_cell=index,
                    check_source=cell.source,
                    statement="\n\n".join(statement),
                    timing=TIMING_TAG in cell.metadata.get("tags", []),
                    network=NETWORK_TAG in cell.metadata.get("tags", []),
                    student_process=STUDENT_PROCESS_TAG in cell.metadata.get("tags", []),
                )
            )
            steps.append(Step("check", index, python_source(cell.source), len(exercises) - 1))
            pending, statement, heading = [], [], None
            continue
        starter = starter_of(index, cell)
        if starter is None:
            setup_ids.add(cell.get("id", ""))
            setup_sources.add(cell.source.strip())
            steps.append(Step("setup", index, python_source(cell.source)))
        else:
            pending.append((index, cell.get("id", ""), starter, stub_functions(starter)))
            steps.append(Step("setup", index, python_source(starter)))
    setup_ids.discard("")
    return ExerciseSet(
        tuple(exercises), tuple(steps), frozenset(setup_ids), frozenset(setup_sources)
    )


def _name_from_check_id(cell_id: str | None, number: int) -> str:
    if cell_id and cell_id.endswith("-check") and len(cell_id) > len("-check"):
        return cell_id[: -len("-check")]
    return f"exercise-{number}"


def _without_definitions(source: str) -> str:
    """The source without its top-level defs and classes (their lines blanked)."""
    code = python_source(source)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ""
    lines = code.split("\n")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            for lineno in range(first, node.end_lineno + 1):
                lines[lineno - 1] = ""
    return "\n".join(lines)


def check_release_ids(exercises: ExerciseSet) -> list[str]:
    """Problems with the exercises' names and cell ids, one line each ([] when fine)."""
    problems = []
    seen: dict[str, int] = {}
    for ex in exercises.exercises:
        if not ex.functions:
            problems.append(f"{ex.label}: no answer cell with a stub before its check")
            continue
        if ex.name in seen:
            problems.append(
                f"{ex.label}: named {ex.name!r} like exercise {seen[ex.name]}; each exercise "
                "needs a function of its own name"
            )
        seen[ex.name] = ex.number
        answers, check = ex.expected_ids()
        if not all(_CELL_ID.match(i) for i in (*answers, check)):
            problems.append(f"{ex.label}: {ex.name!r} does not make a valid cell id")
        elif ex.answer_ids != answers or ex.check_id != check:
            problems.append(
                f"{ex.label} ({ex.name}): cell ids {[*ex.answer_ids, ex.check_id]} should be "
                f"{[*answers, check]}; run `minillm exercises release --fix-ids`"
            )
    return problems


def assign_release_ids(nb: nbformat.NotebookNode) -> bool:
    """Give the answer and check cells of a solution their stable ids; True if any changed.

    Raises ValueError when an id is taken by a cell that keeps it.
    """
    wanted: dict[int, str] = {}
    for ex in parse_exercises(nb).exercises:
        answers, check = ex.expected_ids()
        wanted.update(zip(ex.answer_cells, answers, strict=True))
        wanted[ex.check_cell] = check
    kept = {cell.get("id") for i, cell in enumerate(nb.cells) if i not in wanted}
    clash = sorted(kept & set(wanted.values()))
    if clash:
        raise ValueError(f"cell ids {clash} are taken by cells that are not exercise cells")
    changed = False
    for index, new in wanted.items():
        if nb.cells[index].get("id") != new:
            nb.cells[index].id = new
            changed = True
    return changed


@dataclasses.dataclass(frozen=True, slots=True)
class StudentCell:
    """A code cell of a submission whose definitions grading takes."""

    exercise: int  # index of the first exercise whose check sees it
    filename: str  # how tracebacks name it
    source: str  # plain Python
    cell_index: int


@dataclasses.dataclass(slots=True)
class StudentCode:
    """What grading takes from a submission, and what it has to say about the rest."""

    cells: list[StudentCell]
    errors: dict[int, str]  # exercise index -> why it fails before any check runs
    notes: dict[int, list[str]]  # exercise index -> remarks shown with its result
    general: list[str]  # remarks about the whole notebook


def student_code(submission: nbformat.NotebookNode, reference: ExerciseSet) -> StudentCode:
    """The student's cells of `submission`, matched to the exercises of `reference`.

    A cell is the answer to exercise k when its id is one of k's answer-cell ids, or when
    it defines a function exercise k asks for. A cell with the id or the source of one of
    the reference's setup cells is the author's: the reference's version of it runs, and an
    edit to it changes nothing. Any other code cell is the student's own (a helper, say):
    its definitions are seen from the exercise of the answer before it on. Check cells of
    the submission are ignored.
    """
    functions = reference.functions()
    answer_ids = {i: k for k, ex in enumerate(reference.exercises) for i in ex.answer_ids if i}
    result = StudentCode(cells=[], errors={}, notes={}, general=[])
    found: set[int] = set()
    current = 0
    edited_setup = []
    bootstrap = bootstrap_index(submission)
    for index, cell in enumerate(submission.cells):
        if cell.cell_type != "code" or graded_points(cell.source) is not None:
            continue
        if index == bootstrap:
            continue
        cell_id = cell.get("id")
        exercise: int | None = answer_ids.get(cell_id)
        if exercise is None:
            if cell.source.strip() in reference.setup_sources:
                continue
            if cell_id in reference.setup_ids:
                edited_setup.append(index)
                continue
            defined = [name for name, _ in top_level_definitions(cell.source)]
            asked = sorted({functions[name] for name in defined if name in functions})
            exercise = asked[0] if asked else None
        if exercise is None:
            filename = f"<your cell {index}>"
            visible_from = current
        else:
            filename = f"<your answer to exercise {reference.exercises[exercise].number}>"
            visible_from = exercise
            current = max(current, exercise)
            found.add(exercise)
        code = python_source(cell.source)
        try:
            ast.parse(code, filename)
        except SyntaxError as exc:
            where = f"line {exc.lineno}" if exc.lineno else "somewhere"
            problem = f"SyntaxError in {filename[1:-1]} ({where}): {exc.msg}"
            if exercise is not None:
                result.errors.setdefault(exercise, problem)
            for k in range(visible_from, len(reference.exercises)):
                if k != exercise:
                    result.notes.setdefault(k, []).append(f"{problem}; nothing in it is defined")
            continue
        result.cells.append(StudentCell(visible_from, filename, code, index))
    if edited_setup:
        cells = ", ".join(str(i) for i in edited_setup)
        which = f"cell {cells} differs" if len(edited_setup) == 1 else f"cells {cells} differ"
        result.general.append(
            f"{which} from the reference's: only answer cells are yours, so the grader runs "
            "the reference's version"
        )
    recorded = {e["name"]: e for e in recorded_exercises(submission)}
    for k, ex in enumerate(reference.exercises):
        if recorded and ex.name not in recorded:
            result.notes.setdefault(k, []).append(
                "this exercise is not in your copy of the notebook: it was added after your "
                "copy was released"
            )
        elif recorded and recorded[ex.name].get("version") != ex.version:
            result.notes.setdefault(k, []).append(
                "the statement or starting code of this exercise changed after your copy was "
                "released; compare your copy with the current one"
            )
        if k not in found and k not in result.errors and ex.functions:
            names = " or ".join(f"`{f}`" for f in ex.functions)
            result.errors[k] = f"no answer: no cell of the notebook defines {names}"
    return result
