"""Grade exercise notebooks: each exercise's check, run on the student's definitions.

    minillm grade exercises/ch00_conventions.ipynb
    minillm grade --reference solutions/ch00_conventions.ipynb submissions/ -j 4
    minillm grade --reference exercises/ submissions/ --report grades.csv --feedback feedback/

An exercise earns its points when its check cell (`# GRADED: N points`) runs without
raising. The checks, the setup cells they rely on and the points come from the reference:
the notebook given with `--reference` (a released exercise or its solution), or, without
it, the notebook itself (one notebook only: several need `--reference`). From a
submission, grading runs the cells that answer the exercises (the cell whose id is the
exercise's, as ids derive from the exercise's name and survive re-releases, or else the
cell that defines the function the exercise asks for) and the student's own helper
cells. Edits to any other cell, check cells included, change nothing.

Each submission and exercise is checked by two processes forked from one that ran only
the reference's code (`minillm.course.sandbox`): the check runs in one, the student's
code in the other, and the check reaches the student's functions only through plain
data (`minillm.course.remote`). A crash or a hang costs only that exercise, one
submission cannot reach another, and nothing the student's process does turns a failed
check into a pass. Checks run on the CPU (CUDA is hidden), so that every submission is
graded on the same device. Flags point the instructor at answers to read: tampering,
code no answer needs, an answer that is one call of its check's oracle, self-grading.

A reference folder (such as `exercises/` or `solutions/`) holds one reference per
chapter; a submission is matched to the one of the same file name, else to the one its
metadata names, else to the one whose functions it defines. A folder of submissions
stands for every `*.ipynb` below it. A notebook that cannot be read is reported with the
error and scores zero; grading goes on with the next. A missing path, or a file that is
not an `.ipynb`, is a one-line error on stderr, and the other paths are still graded.

The exit status says whether grading worked, not how well the students did: 0 when
every path was found and every notebook was graded (whatever the scores), 1 otherwise,
2 for a bad command line.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

import nbformat

from minillm.course.exercise_model import (
    STUB_RAISE,
    ExerciseSet,
    StudentCode,
    parse_exercises,
    recorded_exercises,
    student_code,
    top_level_definitions,
)
from minillm.course.notebook_io import (  # noqa: F401  (the book reads graded points with these)
    GRADED_RE,
    NotebookReadError,
    execute_notebook,
    graded_cells,
    graded_points,
    parse_notebook,
    read_notebook,
)
from minillm.course.sandbox import limits_not_applied

DEFAULT_TIMEOUT_S = 60
SETUP_TIMEOUT_S = 600  # a setup cell of the reference (loading a model, say)
MAX_FILE_BYTES = 10 * 2**20  # files beside a submission that its checks may read
MAX_FILES = 100


@dataclasses.dataclass(slots=True)
class ExerciseGrade:
    """The result of one exercise of one submission."""

    number: int
    name: str
    title: str
    max_points: int
    passed: bool
    error: str | None = None  # one line: "ExceptionName: message", or why it was not run
    message: str | None = None  # the whole message of the exception
    input: str | None = None  # hypothesis's falsifying example
    checked: str | None = None  # the line of the check that failed
    where: str | None = None  # the line of the student's code that raised
    notes: list[str] = dataclasses.field(default_factory=list)
    output: str = ""  # the end of what the check and the student's code printed
    seconds: float | None = None
    flags: list[str] = dataclasses.field(default_factory=list)  # for the instructor to read
    # the check ran in the student's process (it needs the student's live objects): a pass
    # there is only as trustworthy as the student's code
    in_student_process: bool = False

    @property
    def points(self) -> int:
        return self.max_points if self.passed else 0

    def to_dict(self) -> dict:
        return {
            "exercise": self.number,
            "name": self.name,
            "title": self.title,
            "points": self.points,
            "max_points": self.max_points,
            "passed": self.passed,
            "error": self.error,
            "message": self.message,
            "input": self.input,
            "checked": self.checked,
            "where": self.where,
            "notes": self.notes,
            "flags": self.flags,
            "in_student_process": self.in_student_process,
            "seconds": self.seconds,
        }


@dataclasses.dataclass(slots=True)
class NotebookGrade:
    """The exercises of one submission; `error` is set when it could not be graded."""

    path: str
    exercises: list[ExerciseGrade]
    error: str | None = None
    student: str = ""  # how the tables name it; the path when empty
    reference: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    flags: list[str] = dataclasses.field(default_factory=list)  # of the notebook as a whole
    # the limits on the student's process this machine could not apply (see the sandbox)
    limits_not_applied: list[str] = dataclasses.field(default_factory=list)

    @property
    def points(self) -> int:
        return sum(e.points for e in self.exercises)

    @property
    def max_points(self) -> int:
        return sum(e.max_points for e in self.exercises)

    @property
    def label(self) -> str:
        return self.student or self.path

    def all_flags(self) -> list[str]:
        """The notebook's flags, then each exercise's, prefixed with its number."""
        return self.flags + [f"{e.number}: {flag}" for e in self.exercises for flag in e.flags]

    def to_dict(self) -> dict:
        return {
            "student": self.label,
            "path": self.path,
            "reference": self.reference,
            "points": self.points,
            "max_points": self.max_points,
            "error": self.error,
            "notes": self.notes,
            "flags": self.all_flags(),
            "limits_not_applied": self.limits_not_applied,
            "exercises": [e.to_dict() for e in self.exercises],
        }


NOT_ANSWERED = "not answered yet: the starting code still raises NotImplementedError"


def _is_stub(exercise: ExerciseGrade) -> bool:
    """A failure that is the starting code's stub raising, not an answer's."""
    return bool(
        not exercise.passed
        and (exercise.error or "").startswith("NotImplementedError")
        and exercise.where
        and STUB_RAISE in exercise.where
    )


def _unrun(exercises: ExerciseSet | None, error: str) -> list[ExerciseGrade]:
    if exercises is None:
        return []
    return [
        ExerciseGrade(ex.number, ex.name, ex.title, ex.points, passed=False, error=error)
        for ex in exercises.exercises
    ]


# ---------------------------------------------------------------------------------------
# Which reference grades which submission


def match_reference(
    nb: nbformat.NotebookNode, path: pathlib.Path, folder: pathlib.Path
) -> tuple[pathlib.Path | None, str]:
    """The notebook of the reference folder that grades `nb`, and how it was chosen.

    By file name first; then by the notebook name release records in the metadata; then
    the reference most of whose exercise functions `nb` defines.
    """
    candidates = sorted(p for p in folder.glob("*.ipynb"))
    same = folder / path.name
    if same in candidates:
        return same, "file name"
    meta = nb.metadata.get("minillm")
    name = meta.get("notebook") if isinstance(meta, dict) else None
    if isinstance(name, str) and folder / f"{name}.ipynb" in candidates:
        return folder / f"{name}.ipynb", "metadata"
    defined = {
        name
        for cell in nb.cells
        if cell.cell_type == "code"
        for name, _ in top_level_definitions(cell.source)
    }
    best, best_count = None, 0
    for candidate in candidates:
        try:
            ref = read_notebook(candidate)
        except NotebookReadError:
            continue
        wanted = {f for e in recorded_exercises(ref) for f in e.get("functions", [])}
        if not wanted:
            try:
                wanted = set(parse_exercises(ref).functions())
            except ValueError:
                continue
        count = len(wanted & defined)
        if count > best_count:
            best, best_count = candidate, count
    return best, "functions it defines"


# ---------------------------------------------------------------------------------------
# Running the checks


@dataclasses.dataclass(slots=True)
class _Submission:
    path: pathlib.Path
    grade: NotebookGrade
    code: StudentCode


class _Group:
    """Submissions graded against one reference, in one sandbox process."""

    def __init__(self, key: str, exercises: ExerciseSet) -> None:
        self.key = key
        self.exercises = exercises
        self.submissions: list[_Submission] = []


def _copy_beside(path: pathlib.Path, target: pathlib.Path) -> None:
    """Copy the plain files beside a submission (not notebooks, not links, not huge)."""
    target.mkdir(parents=True)
    copied = 0
    for item in sorted(path.parent.iterdir()):
        if copied >= MAX_FILES:
            break
        if item.is_symlink() or not item.is_file() or item.suffix == ".ipynb":
            continue
        if item.stat().st_size > MAX_FILE_BYTES:
            continue
        shutil.copyfile(item, target / item.name)
        copied += 1


# what the grading process inherits from the instructor's environment: no tokens or keys
INHERITED_ENVIRONMENT = (
    "PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LANG",
    "LC_ALL",
    "PYTHONHASHSEED",
    "TRITON_INTERPRET",
    "OMP_NUM_THREADS",
)


def _environment(workdir: str) -> dict[str, str]:
    env = {
        var: value
        for var, value in os.environ.items()
        if var in INHERITED_ENVIRONMENT or var.startswith(("MINILLM_", "HF_HUB_OFFLINE"))
    }
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": "",  # every submission graded on the same device: the CPU
            "TOKENIZERS_PARALLELISM": "false",  # its thread pool and fork do not mix
            "MPLBACKEND": "Agg",
            "HOME": workdir,
            "TMPDIR": workdir,
        }
    )
    return env


# libraries the chapters use whose import rebinds attributes of the standard library: when
# a submission imports one, the grading process imports it first, so that the import is
# not taken for tampering
PREIMPORTED = ("torch", "numpy", "transformers", "scipy")


def _imports(code: StudentCode) -> set[str]:
    names = set()
    for cell in code.cells:
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names & set(PREIMPORTED)


def _sandbox_command() -> list[str]:
    """The grading process: isolated mode (-I: no environment variables, no user site), with
    the same minillm as this process, wherever it was imported from."""
    root = str(pathlib.Path(__file__).resolve().parents[2])
    code = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from minillm.course.sandbox import main; sys.exit(main())"
    )
    return [sys.executable, "-I", "-c", code]


def _run_group(
    group: _Group,
    timeout_s: int,
    jobs: int,
    confine: bool,
    on_event: Callable[[dict], None],
) -> list[str]:
    """Grade the submissions of one group; returns the problems of grading itself."""
    exercises = group.exercises
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as run_root:
        root = pathlib.Path(run_root)
        payload = []
        for i, sub in enumerate(group.submissions):
            files = root / f"files-{i}"
            try:
                _copy_beside(sub.path, files)
            except OSError:
                files.mkdir(exist_ok=True)
            # the grading process never holds a student's code: each student's process reads
            # its own cells from this file, which no other student's process can read
            cells_path = root / f"cells-{i}.json"
            fd = os.open(cells_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps([dataclasses.asdict(c) for c in sub.code.cells]))
            payload.append(
                {
                    "files": str(files),
                    "cells_path": str(cells_path),
                    "skip": sorted(sub.code.errors),
                }
            )
        protected = sorted(
            {str(s.path.resolve().parent) for s in group.submissions}
            | {str(pathlib.Path(group.key).resolve().parent)}
        )
        job = {
            "steps": [dataclasses.asdict(s) for s in exercises.steps],
            "exercises": [
                {
                    "number": ex.number,
                    "functions": list(ex.functions),
                    "timing": ex.timing,
                    "network": ex.network,
                    "student_process": ex.student_process,
                }
                for ex in exercises.exercises
            ],
            "submissions": payload,
            "jobs": jobs,
            "timeout_s": timeout_s,
            "setup_timeout_s": SETUP_TIMEOUT_S,
            "workdir": run_root,
            "protected": protected,
            "confine": confine,
            "preimport": sorted(set().union(*(_imports(s.code) for s in group.submissions))),
        }
        zygote_dir = root / "sandbox"
        zygote_dir.mkdir()
        stderr_path = root / "sandbox-stderr.txt"
        with open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                _sandbox_command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=zygote_dir,
                env=_environment(str(zygote_dir)),
                start_new_session=True,
            )
            done = _read_events(process, job, timeout_s, on_event)
        if not done:
            tail = _last_lines(stderr_path) or _last_lines(root / "setup-output.txt")
            problems.append(
                f"the grading process stopped (exit status {process.returncode})"
                + (f": {tail}" if tail else "")
            )
    return problems


def _read_events(
    process: subprocess.Popen, job: dict, timeout_s: int, on_event: Callable[[dict], None]
) -> bool:
    """Feed the job to the sandbox and pass on its events; True when it finished."""
    lines: queue.Queue[bytes | None] = queue.Queue()

    def reader() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    try:
        process.stdin.write(json.dumps(job).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    # a watchdog above the sandbox's own limits: a setup cell stuck in native code
    silence_s = SETUP_TIMEOUT_S + timeout_s + 60
    done = False
    try:
        while True:
            try:
                line = lines.get(timeout=silence_s)
            except queue.Empty:
                break
            if line is None:
                break
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "done":
                done = True
            else:
                on_event(event)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    return done


def _last_lines(path: pathlib.Path, count: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-count:])


SELF_GRADED = "self-graded: checked by the notebook's own check cells, not a reference's"
# what a solution has no use for, and an attack on the grader or the checks does
SUSPICIOUS = (
    ("_getframe", "reads the call stack"),
    ("f_back", "reads the call stack"),
    ("f_globals", "reads the call stack"),
    ("f_locals", "reads the call stack"),
    ("settrace", "traces execution"),
    ("setprofile", "traces execution"),
    ("__code__", "replaces a function's code"),
    ("__torch_function__", "overrides torch functions"),
    ("__torch_dispatch__", "overrides torch functions"),
    ("__eq__", "overrides equality"),
    ("__ne__", "overrides equality"),
    ("import __main__", "imports __main__"),
    ("ctypes", "uses ctypes"),
    ("gc.get_objects", "walks the heap"),
    ("gc.get_referrers", "walks the heap"),
    ("os.write", "writes to file descriptors"),
    ("os.fork", "forks"),
    ("os._exit", "exits the process"),
    ("sys.modules", "edits sys.modules"),
    ("builtins", "edits builtins"),
)


def _suspicious(source: str) -> list[str]:
    found = []
    for needle, what in SUSPICIOUS:
        if needle in source and f"{what} ({needle})" not in found:
            found.append(f"{what} ({needle})")
    return found


def _bound_by_setup(exercises: ExerciseSet) -> set[str]:
    """Names the reference's setup imports from minillm or kernels, or defines itself."""
    names: set[str] = set()
    for step in exercises.steps:
        if step.kind != "setup":
            continue
        try:
            tree = ast.parse(step.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "minillm",
                "kernels",
            ):
                names.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(
                    (a.asname or a.name).split(".")[0]
                    for a in node.names
                    if a.name.split(".")[0] in ("minillm", "kernels")
                )
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
    return names


def _setup_names(exercises: ExerciseSet) -> set[str]:
    """Every name the reference's setup binds at its top level."""
    names: set[str] = set()
    for step in exercises.steps:
        if step.kind != "setup":
            continue
        try:
            tree = ast.parse(step.source)
        except SyntaxError:
            continue
        for node in tree.body:
            for sub in ast.walk(node) if isinstance(node, ast.Assign | ast.AnnAssign) else ():
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
            if isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
    return names


def _patched_setup_objects(source: str, setup: set[str]) -> list[str]:
    """`llm.generate = ...` and the like: attributes of the setup's objects an answer sets."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[str] = []
    # a function's own parameter named like a setup object is the caller's argument
    setup = setup - {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                root = sub
                while isinstance(root, ast.Attribute | ast.Subscript):
                    root = root.value
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(root, ast.Name)
                    and root.id in setup
                    and _dotted(sub) not in found
                ):
                    found.append(_dotted(sub))
    return found


def _dotted(node: ast.expr) -> str:
    try:
        return ast.unparse(node)
    except Exception:
        return ""


def _called_names(source: str) -> set[str]:
    """Dotted names a piece of code calls or subclasses ("rtn", "roofline.gemm_flops")."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            used.add(_dotted(node.func))
        elif isinstance(node, ast.ClassDef):
            used.update(_dotted(b) for b in node.bases)
    return used


def _one_line_answers(source: str, functions: set[str]) -> set[str]:
    """The names an answer consists of calling or subclassing, and nothing else: a function
    of the exercise whose body is one `return f(...)`, or a class whose body is `pass`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found = set()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name not in functions:
            continue
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if isinstance(node, ast.ClassDef):
            if all(isinstance(b, ast.Pass) for b in body):
                found.update(_dotted(b) for b in node.bases)
        elif len(body) == 1 and isinstance(body[0], ast.Return | ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Call):
                found.add(_dotted(value.func))
    return found


def code_flags(code: StudentCode, exercises: ExerciseSet) -> dict[int, list[str]]:
    """Flags for the instructor, by exercise: code no answer needs (an attack on the grader
    or on the checks), and an answer that is one call of what its check compares it with."""
    flags: dict[int, list[str]] = {}
    functions = set(exercises.functions())
    oracles = _bound_by_setup(exercises) - functions
    checks = {s.exercise: s.source for s in exercises.steps if s.kind == "check"}
    setup = _setup_names(exercises)
    for k, _ in enumerate(exercises.exercises):
        found: list[str] = []
        for cell in code.cells:
            if cell.exercise <= k:
                found.extend(f for f in _suspicious(cell.source) if f not in found)
                found.extend(
                    f"changes the notebook's objects ({target} = ...)"
                    for target in _patched_setup_objects(cell.source, setup)
                    if f"changes the notebook's objects ({target} = ...)" not in found
                )
        if found:
            flags.setdefault(k, []).append("suspicious code: " + ", ".join(found))
        check_uses = _called_names(checks.get(k, ""))
        answers = [c for c in code.cells if c.exercise == k and c.filename.startswith("<your ans")]
        shared = sorted(
            {
                name
                for cell in answers
                for name in _one_line_answers(cell.source, functions)
                if name in check_uses and name.split(".")[0] in oracles
            }
        )
        if shared:
            flags.setdefault(k, []).append(
                "calls what the check compares with: " + ", ".join(shared)
            )
    return flags


def grade_notebooks(
    paths: list[pathlib.Path],
    reference: pathlib.Path | None = None,
    timeout_s: int = DEFAULT_TIMEOUT_S,
    jobs: int = 1,
    labels: list[str] | None = None,
    confine: bool = True,
    on_progress: Callable[[NotebookGrade, ExerciseGrade], None] | None = None,
) -> tuple[list[NotebookGrade], list[str]]:
    """Grade the notebooks at `paths`; returns their grades (in order) and the problems.

    A problem is a line about grading itself (a reference whose setup failed, a sandbox
    that stopped); the grades are complete
    whatever happened, with each exercise that could not be checked failed and saying why.
    """
    labels = labels or [str(p) for p in paths]
    grades: list[NotebookGrade] = []
    groups: dict[str, _Group] = {}
    problems: list[str] = []
    references: dict[str, ExerciseSet | str] = {}

    def load_reference(key: str, nb: nbformat.NotebookNode | None) -> ExerciseSet | str:
        if key not in references:
            try:
                ref_nb = nb if nb is not None else read_notebook(key)
                references[key] = parse_exercises(ref_nb)
            except (NotebookReadError, ValueError) as exc:
                references[key] = f"reference {key}: {exc}"
        return references[key]

    for path, label in zip(paths, labels, strict=True):
        path = pathlib.Path(path)
        grade = NotebookGrade(str(path), [], student=label)
        grades.append(grade)
        try:
            nb = read_notebook(path)
        except NotebookReadError as exc:
            grade.error = str(exc)
            if reference is not None and reference.is_file():
                ref = load_reference(str(reference), None)
                grade.exercises = _unrun(ref if isinstance(ref, ExerciseSet) else None, "not run")
            continue
        if reference is None:
            key, ref = str(path), load_reference(str(path), nb)
        elif reference.is_dir():
            chosen, _how = match_reference(nb, path, reference)
            if chosen is None:
                grade.error = (
                    f"no notebook of {reference} matches it (by file name, by the notebook its "
                    "metadata names, or by the functions it defines): give the reference "
                    f"notebook itself, --reference {reference}/<name>.ipynb"
                )
                continue
            key, ref = str(chosen), load_reference(str(chosen), None)
        else:
            key, ref = str(reference), load_reference(str(reference), None)
        grade.reference = key
        if isinstance(ref, str):
            grade.error = ref
            continue
        code = student_code(nb, ref)
        grade.notes = list(code.general)
        if reference is None:
            grade.notes.extend(_own_checks_changed(nb, ref))
            grade.flags.append(SELF_GRADED)
        grade.exercises = [
            ExerciseGrade(
                ex.number,
                ex.name,
                ex.title,
                ex.points,
                passed=False,
                error=code.errors.get(k, "not graded"),
                notes=list(code.notes.get(k, [])),
            )
            for k, ex in enumerate(ref.exercises)
        ]
        for k, flags in code_flags(code, ref).items():
            grade.exercises[k].flags.extend(flags)
        if key not in groups:
            groups[key] = _Group(key, ref)
        groups[key].submissions.append(_Submission(path, grade, code))

    missing = limits_not_applied(confine) if groups else []
    for group in groups.values():
        for sub in group.submissions:
            sub.grade.limits_not_applied = list(missing)
        reported = set()

        def on_event(event: dict, group: _Group = group, reported: set = reported) -> None:
            if event.get("event") == "setup":
                line = f"{group.key}, cell {event['cell']}: {event['error']}"
                if line not in reported:
                    reported.add(line)
                    problems.append(f"setup failed: {line}")
                    for sub in group.submissions:
                        sub.grade.notes.append(
                            f"the notebook's cell {event['cell']} raised {event['error']}: "
                            "the checks that rely on it fail"
                        )
            elif event.get("event") == "result":
                sub = group.submissions[event["submission"]]
                exercise = sub.grade.exercises[event["exercise"]]
                exercise.passed = event.get("passed") is True
                for field in ("error", "message", "input", "checked", "where"):
                    setattr(exercise, field, event.get(field))
                exercise.notes.extend(event.get("notes") or [])
                if (exercise.error or "").startswith("Tampering"):
                    exercise.flags.insert(0, "tampering")
                if _is_stub(exercise):
                    exercise.error = NOT_ANSWERED
                    exercise.message = exercise.checked = exercise.where = None
                exercise.in_student_process = event.get("student_process") is True
                exercise.output = event.get("output") or ""
                exercise.seconds = event.get("seconds")
                if on_progress is not None:
                    on_progress(sub.grade, exercise)

        group_problems = _run_group(group, timeout_s, jobs, confine, on_event)
        for problem in group_problems:
            problems.append(f"{group.key}: {problem}")
            for sub in group.submissions:
                for exercise in sub.grade.exercises:
                    if exercise.error == "not graded":
                        exercise.error = f"not graded: {problem}"
    return grades, problems


def _own_checks_changed(nb: nbformat.NotebookNode, exercises: ExerciseSet) -> list[str]:
    """What a notebook graded by its own checks says about checks it lost or re-scored,
    compared with what its release recorded."""
    recorded = {e["name"]: e for e in recorded_exercises(nb)}
    present = {ex.name: ex for ex in exercises.exercises}
    notes = [
        f"exercise {e.get('number')} ({name}) was released with a check that this notebook "
        "no longer has; grade it with --reference to count it"
        for name, e in recorded.items()
        if name not in present
    ]
    notes.extend(
        f"exercise {ex.number} ({ex.name}) is worth {recorded[ex.name].get('points')} points "
        f"as released, not {ex.points}"
        for ex in exercises.exercises
        if ex.name in recorded and recorded[ex.name].get("points") != ex.points
    )
    return notes


def grade_notebook(
    path: str | os.PathLike[str],
    timeout_s: int = DEFAULT_TIMEOUT_S,
    reference: str | os.PathLike[str] | None = None,
) -> NotebookGrade:
    """Grade one notebook (see grade_notebooks)."""
    grades, _ = grade_notebooks(
        [pathlib.Path(path)], pathlib.Path(reference) if reference else None, timeout_s
    )
    return grades[0]


# ---------------------------------------------------------------------------------------
# Tables, reports and feedback


def collect_notebooks(paths: list[str]) -> tuple[list[tuple[pathlib.Path, str]], list[str]]:
    """Expand folders into their notebooks, each with the name the tables give it.

    A notebook inside a folder argument is named by its path below that folder, without
    `.ipynb` (`alice/ch00_conventions`); a file argument by the path as given. Returns
    ([(path, name)], one error line per bad path).
    """
    notebooks: list[tuple[pathlib.Path, str]] = []
    problems: list[str] = []
    for name in paths:
        path = pathlib.Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if not found:
                problems.append(f"{name}: folder holds no .ipynb notebooks")
            notebooks.extend((p, str(p.relative_to(path).with_suffix(""))) for p in found)
        elif not path.exists():
            problems.append(f"{name}: no such file or folder")
        elif path.suffix != ".ipynb":
            problems.append(f"{name}: not a notebook (expected an .ipynb file or a folder)")
        else:
            notebooks.append((path, name))
    return notebooks, problems


def _exercise_line(e: ExerciseGrade) -> str:
    return "passed" if e.passed else f"failed: {e.error}"


def format_feedback(grade: NotebookGrade) -> str:
    """One notebook's grade, exercise by exercise, with what to fix."""
    head = grade.label
    if grade.reference and grade.reference != grade.path:
        head += f"  (checks from {grade.reference})"
    lines = [head]
    if grade.error:
        lines.append(f"  not graded: {grade.error}")
    width = max([len(e.name) for e in grade.exercises] + [4])
    if grade.exercises:
        lines.append(f"  {'exercise':>8}  {'name':<{width}}  {'points':>6}  result")
    pad = " " * (2 + 8 + 2 + width + 2 + 6 + 2)
    for e in grade.exercises:
        points = f"{e.points}/{e.max_points}"
        lines.append(f"  {e.number:>8}  {e.name:<{width}}  {points:>6}  {_exercise_line(e)}")
        if not e.passed:
            for label, value in (
                ("input", e.input),
                ("checked", e.checked),
                ("raised at", e.where),
            ):
                if value:
                    lines.append(f"{pad}{label}: {value}")
        for note in e.notes:
            lines.append(f"{pad}note: {note}")
        for flag in e.flags:
            lines.append(f"{pad}flag: {flag}")
    for note in grade.notes:
        lines.append(f"  note: {note}")
    for flag in grade.flags:
        lines.append(f"  flag: {flag}")
    for limit in grade.limits_not_applied:
        lines.append(f"  limit not applied: {limit}")
    lines.append(f"  {'total':>8}  {'':<{width}}  {f'{grade.points}/{grade.max_points}':>6}")
    return "\n".join(line.rstrip() for line in lines)


def _by_reference(grades: list[NotebookGrade]) -> dict[str, list[NotebookGrade]]:
    """The grades of each reference; a notebook that could not be matched to any goes with
    the others when they all have the same reference."""
    references = {g.reference for g in grades if g.reference}
    only = references.pop() if len(references) == 1 else ""
    groups: dict[str, list[NotebookGrade]] = {}
    for grade in grades:
        groups.setdefault(grade.reference or only, []).append(grade)
    return groups


def format_summary(grades: list[NotebookGrade]) -> str:
    """A table per reference: one row per student, a column per exercise, and the total."""
    blocks = []
    for reference, group in _by_reference(grades).items():
        template = next((g for g in group if g.exercises), None)
        numbers = [e.number for e in template.exercises] if template else []
        header = ["student", *(str(n) for n in numbers), "total", ""]
        flagged = any(_flag_summary(g) for g in group)
        rows = [header]
        for grade in group:
            cells = {e.number: str(e.points) for e in grade.exercises}
            total = f"{grade.points}/{grade.max_points}"
            rows.append(
                [
                    grade.label,
                    *(cells.get(n, "-") for n in numbers),
                    total,
                    "  ".join(
                        part
                        for part in (
                            f"not graded: {grade.error}" if grade.error else "",
                            f"flags: {_flag_summary(grade)}" if _flag_summary(grade) else "",
                        )
                        if part
                    ),
                ]
            )
        if template:
            rows.append(["max", *(str(e.max_points) for e in template.exercises), "", ""])
        widths = [max(len(r[c]) for r in rows) for c in range(len(header) - 1)]
        title = f"checks from {reference}" if reference else "not graded"
        lines = [title]
        for row in rows:
            first = f"{row[0]:<{widths[0]}}"
            rest = "  ".join(f"{v:>{w}}" for v, w in zip(row[1:-1], widths[1:], strict=True))
            lines.append(f"{first}  {rest}  {row[-1]}".rstrip())
        if template:
            names = ", ".join(f"{e.number} {e.name}" for e in template.exercises)
            lines.append(f"exercises: {names}")
        inside = sorted({e.number for g in group for e in g.exercises if e.in_student_process})
        if inside:
            lines.append(
                "checked in the student's own process, where a pass can be forged (read these "
                f"answers): exercise {', '.join(str(n) for n in inside)}"
            )
        for limit in dict.fromkeys(m for g in group for m in g.limits_not_applied):
            lines.append(f"limit not applied: {limit}")
        if flagged:
            lines.append(
                "flags: read these answers before counting their points (the feedback and the "
                "reports say why each was flagged)"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _flag_summary(grade: NotebookGrade) -> str:
    """A notebook's flags in a few words: 'self-graded; tampering 1; suspicious code 1, 3'."""
    kinds: dict[str, list[str]] = {}
    for e in grade.exercises:
        for flag in e.flags:
            kinds.setdefault(flag.split(":")[0], []).append(str(e.number))
    parts = ["self-graded"] if SELF_GRADED in grade.flags else []
    parts += [f"{kind} {', '.join(dict.fromkeys(numbers))}" for kind, numbers in kinds.items()]
    return "; ".join(parts)


def _cell(value: object) -> object:
    """A CSV cell that no spreadsheet reads as a formula (a student names exceptions)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _exercise_columns(grades: list[NotebookGrade]) -> list[tuple[str, int, str]]:
    """(reference, number, column name) of every exercise, in order of first appearance."""
    by_ref = _by_reference(grades)
    several = len([r for r in by_ref if r]) > 1
    columns = []
    for reference, group in by_ref.items():
        template = next((g for g in group if g.exercises), None)
        if template is None:
            continue
        prefix = f"{pathlib.Path(reference).stem} " if several else ""
        columns.extend(
            (reference, e.number, f"{prefix}{e.number} {e.name}") for e in template.exercises
        )
    return columns


def write_report(grades: list[NotebookGrade], report: pathlib.Path) -> list[pathlib.Path]:
    """Write the grades; returns the files written.

    `.json`: every notebook with every exercise's result and feedback. `.csv`: one row per
    student (points per exercise and the total), and beside it `<name>.exercises.csv`, one
    row per student and exercise with the feedback.
    """
    if report.suffix == ".json":
        data = {"notebooks": [grade.to_dict() for grade in grades]}
        report.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        return [report]
    if report.suffix != ".csv":
        raise ValueError(f"report must end in .json or .csv, got {report}")
    columns = _exercise_columns(grades)
    with report.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "student",
                "notebook",
                "reference",
                *(c for *_, c in columns),
                "points",
                "max_points",
                "error",
                "flags",
                "limits_not_applied",
            ]
        )
        for grade in grades:
            points = {(grade.reference, e.number): e.points for e in grade.exercises}
            row = [
                grade.label,
                grade.path,
                grade.reference,
                *(points.get((ref, n), "") for ref, n, _ in columns),
                grade.points,
                grade.max_points,
                grade.error or "",
                " | ".join(grade.all_flags()),
                " | ".join(grade.limits_not_applied),
            ]
            writer.writerow([_cell(v) for v in row])
    detail = report.with_name(report.stem + ".exercises.csv")
    with detail.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "student",
                "notebook",
                "reference",
                "exercise",
                "name",
                "title",
                "points",
                "max_points",
                "passed",
                "error",
                "input",
                "checked",
                "raised_at",
                "notes",
                "flags",
                "limits_not_applied",
            ]
        )
        for grade in grades:
            for e in grade.exercises:
                row = [
                    grade.label,
                    grade.path,
                    grade.reference,
                    e.number,
                    e.name,
                    e.title,
                    e.points,
                    e.max_points,
                    e.passed,
                    e.error or "",
                    e.input or "",
                    e.checked or "",
                    e.where or "",
                    " | ".join(e.notes + grade.notes),
                    " | ".join(grade.flags + e.flags),
                    " | ".join(grade.limits_not_applied),
                ]
                writer.writerow([_cell(v) for v in row])
    return [report, detail]


def write_feedback(grades: list[NotebookGrade], folder: pathlib.Path) -> list[pathlib.Path]:
    """One text file per student, `<student>.txt`, with format_feedback's view of it."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for grade in grades:
        name = grade.label.replace(os.sep, "__").replace("/", "__")
        path = folder / f"{pathlib.Path(name).name}.txt"
        path.write_text(format_feedback(grade) + "\n", encoding="utf-8")
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------
# The command line


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "grade",
        help="run exercise notebooks' checks and score them",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="notebooks or folders of them")
    parser.add_argument(
        "--reference",
        type=pathlib.Path,
        metavar="PATH",
        help="take the checks, their setup and the points from this notebook, or from the "
        "matching notebook of this folder (exercises/ or solutions/)",
    )
    parser.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="check N exercises at once (default 1); checks tagged `timing` still run alone",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time limit per exercise (default {DEFAULT_TIMEOUT_S})",
    )
    parser.add_argument(
        "--report",
        type=pathlib.Path,
        metavar="FILE",
        help="also write the grades to FILE.csv (one row per student, and FILE.exercises.csv "
        "with each exercise's feedback) or FILE.json",
    )
    parser.add_argument(
        "--feedback",
        type=pathlib.Path,
        metavar="FOLDER",
        help="write each student's feedback to FOLDER/<student>.txt",
    )
    parser.set_defaults(func=_run)


def _progress(total: int) -> Callable[[NotebookGrade, ExerciseGrade], None] | None:
    if not sys.stderr.isatty() or total <= 1:
        return None
    done = [0]

    def show(grade: NotebookGrade, exercise: ExerciseGrade) -> None:
        done[0] += 1
        sys.stderr.write(f"\rgrading: {done[0]}/{total} exercises checked")
        if done[0] == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _run(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"minillm grade: {message}", file=sys.stderr)
        return 2

    if args.report is not None and args.report.suffix not in (".json", ".csv"):
        return fail(f"--report must end in .json or .csv, got {args.report}")
    if args.timeout <= 0:
        return fail(f"--timeout must be > 0, got {args.timeout}")
    if args.jobs <= 0:
        return fail(f"--jobs must be > 0, got {args.jobs}")
    if args.reference is not None and not args.reference.exists():
        return fail(f"--reference {args.reference}: no such file or folder")
    notebooks, problems = collect_notebooks(args.paths)
    for problem in problems:
        print(f"minillm grade: {problem}", file=sys.stderr)
    if args.reference is None and len(notebooks) > 1:
        return fail(
            "several notebooks need --reference (for example --reference exercises/): "
            "without it each notebook is graded by its own check cells, which its author "
            "can edit, and its other cells run outside the sandbox"
        )
    total = 0
    if notebooks:
        # an estimate for the progress line: the exercises of the first notebook, each
        total = len(notebooks) * max(1, _count_exercises(notebooks[0][0], args.reference))
    grades, grading_problems = grade_notebooks(
        [p for p, _ in notebooks],
        args.reference,
        args.timeout,
        args.jobs,
        labels=[label for _, label in notebooks],
        on_progress=_progress(total),
    )
    for problem in grading_problems:
        print(f"minillm grade: {problem}", file=sys.stderr)
    for limit in dict.fromkeys(m for g in grades for m in g.limits_not_applied):
        print(f"minillm grade: warning: limit not applied: {limit}", file=sys.stderr)
    if len(grades) == 1:
        print(format_feedback(grades[0]))
    elif grades:
        print(format_summary(grades))
        if args.feedback is None and any(e.error for g in grades for e in g.exercises):
            print(
                "minillm grade: --feedback FOLDER writes what failed, for each student",
                file=sys.stderr,
            )
    if args.report is not None:
        write_report(grades, args.report)
    if args.feedback is not None:
        write_feedback(grades, args.feedback)
    ok = not problems and not grading_problems and all(g.error is None for g in grades)
    return 0 if ok else 1


def _count_exercises(path: pathlib.Path, reference: pathlib.Path | None) -> int:
    try:
        source = reference if reference is not None and reference.is_file() else path
        return len(graded_cells(read_notebook(source)))
    except (NotebookReadError, OSError):
        return 1
