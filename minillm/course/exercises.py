"""Release the exercise notebooks: `exercises/` is generated from `solutions/`.

A solution notebook (`solutions/chNN_<topic>.ipynb`, stored with its outputs) is the
single source of an exercise. `minillm exercises release` writes, for each one, the
student's copy in `exercises/`:

- every `### BEGIN SOLUTION` ... `### END SOLUTION` region of a code cell (whole lines,
  markers included) becomes `# YOUR CODE HERE` and a `raise NotImplementedError(...)`
  line, at the indentation of the BEGIN line;
- outputs and execution counts are cleared;
- cell ids are the solution's. Those of the exercises derive from their names (see
  `minillm.course.exercise_model`): the answer cell of the exercise whose function is
  `packed_bytes` is `packed_bytes`, its check `packed_bytes-check`. Inserting, moving or
  removing cells therefore never changes the id of another exercise's cells, and
  grading matches a student's answers to the reference by these ids across releases;
- metadata is normalized: the notebook keeps a python3 kernelspec, `language_info.name`
  and, under `minillm`, the notebook's name and its exercises (number, name, points,
  the functions asked for, the starting code of each answer cell, and a version hash of
  the statement and starting code, which tells grading that a submission predates a
  changed exercise); a cell keeps only `tags`, `editable` and `deletable`; the JSON is
  nbformat 4.5 as `nbformat.writes` formats it, so releasing twice gives identical bytes;
- a solution's title (a `# ` heading right after the bootstrap) comes first, above the
  bootstrap, so that the exercise page opens with it; each graded cell is tagged
  `hide-input`, so the book shows its check collapsed rather than its answers;
- `exercises/conftest.py` makes `pytest --nbval-lax` name each graded cell
  "Exercise N", as the notebook's headings and `minillm grade` do.

Every solution must start with the bootstrap cell (`minillm.course.bootstrap`) for the
repository URL in `_config.yml`. Release refuses a notebook whose first cell is not
exactly that cell; `release --fix-bootstrap` first rewrites the solution notebooks,
replacing an outdated bootstrap cell or inserting one at the top, then releases.

Release validates every solution notebook before it writes anything: a marker that is
unbalanced, nested, or outside a code cell, a malformed `# GRADED` line, a missing
bootstrap, a graded cell under the heading of another exercise number, two exercises
of one name, or exercise cell ids that are not derived from the names is an error naming
the notebook and the cell, and no file is written. `release --fix-ids` first gives the
solutions' exercise cells their ids.
Exercise notebooks whose solution is gone are removed. `minillm exercises check`
exits 1 and names each file of `exercises/` that differs from what release would
write, is missing, or has no source in `solutions/`.

How an author writes an exercise: under a heading `## Exercise N: title (P points)`, a
code cell defines the function the student writes, with the answer between the markers;
the next code cell, starting with `# GRADED: N points`, checks it. Only graded cells may
call the student's functions, so that the released notebook fails exactly at its graded
cells, and a check may use what setup cells and answer cells define but not what an
earlier check defines (grading runs each check on its own). A check that measures time
carries the cell tag `timing`, so that parallel grading runs it alone; one whose processes
talk over TCP (torch.distributed on loopback) carries `network`, which the grader's
confinement then allows.
`minillm exercises execute` runs the solution notebooks and stores their outputs.

A class's private variant: `release --seed S --out DIR` writes the exercises into DIR,
outside the repository (or in a folder git ignores), with the line
`CLASS_SEED = 'S'` at the top of every check (see `minillm.course.variants`). Checks
that draw their worked examples through `variant` then use this class's inputs and
expected values; grade with `minillm grade submissions/ --reference DIR`. The statements
and starting code are the public ones, so a submission made from the public edition is
graded as current.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import re
import subprocess
import sys

import nbformat

from minillm.course.bootstrap import (
    bootstrap_cell,
    is_bootstrap_cell,
    looks_like_bootstrap_cell,
    repository_url,
)
from minillm.course.exercise_model import (
    METADATA_KEY,
    ExerciseSet,
    assign_release_ids,
    check_release_ids,
    has_marker,
    parse_exercises,
    strip_solutions,
)
from minillm.course.grading import DEFAULT_TIMEOUT_S
from minillm.course.notebook_io import (
    GRADED_RE,
    NotebookReadError,
    execute_notebook,
    read_notebook,
)

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}
CELL_METADATA_KEYS = ("deletable", "editable", "tags")
_GRADED_LINE = re.compile(r"^\s*#\s*GRADED\b")


class ReleaseError(Exception):
    """Solution notebooks that cannot be released; the message lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _check_graded_markers(source: str) -> None:
    for line in source.split("\n"):
        if _GRADED_LINE.match(line) and not GRADED_RE.match(line):
            raise ValueError(f"malformed {line.strip()!r}, expected '# GRADED: N points'")


CONFTEST_NAME = "conftest.py"
CONFTEST = '''"""Written by `minillm exercises release`: pytest --nbval-lax names each graded cell
"Exercise N", as the notebook's headings and `minillm grade` do."""

from minillm.course.nbval_names import pytest_collection_modifyitems  # noqa: F401
'''


def _check_ids_and_checks(solution: nbformat.NotebookNode) -> ExerciseSet:
    """The solution's exercises; ValueError for misnamed cells or checks that need others."""
    exercises = parse_exercises(solution)
    problems = check_release_ids(exercises)
    problems.extend(_checks_using_checks(exercises))
    if problems:
        raise ValueError("; ".join(problems))
    return exercises


def _checks_using_checks(exercises: ExerciseSet) -> list[str]:
    """Checks that use a name only an earlier check defines (each check runs on its own)."""
    import ast

    def bound(code: str) -> set[str]:
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return set()
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
        return names

    problems = []
    by_checks: set[str] = set()
    by_setup: set[str] = set()
    for step in exercises.steps:
        if step.kind == "setup":
            by_setup |= bound(step.source)
            continue
        try:
            tree = ast.parse(step.source)
        except SyntaxError:
            continue
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        own = bound(step.source)
        borrowed = sorted((used - own - by_setup) & by_checks)
        if borrowed:
            number = exercises.exercises[step.exercise].number
            problems.append(
                f"the check of exercise {number} uses {', '.join(borrowed)}, which only an "
                "earlier check defines: define it in a setup cell"
            )
        by_checks |= own
    return problems


def exercise_notebook(solution: nbformat.NotebookNode, repo_url: str, name: str = "") -> str:
    """The released exercise (notebook JSON text) for the solution notebook `name`.

    Raises ValueError starting with "cell N:" for the first problem found.
    """
    if not solution.cells or not is_bootstrap_cell(solution.cells[0], repo_url):
        raise ValueError(
            f"cell 0: not the bootstrap cell for {repo_url}; run "
            "`minillm exercises release --fix-bootstrap` to insert or update it"
        )
    cells = []
    for index, cell in enumerate(solution.cells):
        source = cell.source
        try:
            if cell.cell_type == "code":
                source = strip_solutions(source)
            elif has_marker(source):
                raise ValueError(f"solution markers in a {cell.cell_type} cell (code cells only)")
            if cell.cell_type == "code":
                _check_graded_markers(source)
        except ValueError as exc:
            raise ValueError(f"cell {index}: {exc}") from None
        if cell.cell_type == "code":
            new = nbformat.v4.new_code_cell(source)
        elif cell.cell_type == "markdown":
            new = nbformat.v4.new_markdown_cell(source)
            if "attachments" in cell:
                new.attachments = cell.attachments
        else:
            new = nbformat.v4.new_raw_cell(source)
        new.metadata = {k: cell.metadata[k] for k in CELL_METADATA_KEYS if k in cell.metadata}
        new.id = cell.get("id") or f"cell-{index}"
        cells.append(new)
    exercises = _check_ids_and_checks(solution)
    for cell in cells:
        # the book collapses each check: the reader sees the exercise, not its answers
        if cell.cell_type == "code" and GRADED_RE.match(cell.source):
            tags = list(cell.metadata.get("tags", []))
            cell.metadata["tags"] = tags if "hide-input" in tags else [*tags, "hide-input"]
    if len(cells) > 1 and cells[1].cell_type == "markdown" and cells[1].source.startswith("# "):
        # the title above the bootstrap, so that the page opens with it; the bootstrap
        # stays the first code cell
        cells[0], cells[1] = cells[1], cells[0]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = {
        "kernelspec": dict(KERNELSPEC),
        "language_info": {"name": "python"},
        METADATA_KEY: exercises.metadata(name),
    }
    nbformat.validate(nb)
    return nbformat.writes(nb, version=4) + "\n"


def plan_release(solutions_dir: pathlib.Path, repo_url: str) -> dict[str, str]:
    """Validate every solution notebook; returns {file name: exercise text}.

    Raises ReleaseError listing every problem in every notebook.
    """
    if not solutions_dir.is_dir():
        raise ReleaseError([f"{solutions_dir}: no such folder of solution notebooks"])
    planned: dict[str, str] = {}
    problems: list[str] = []
    for path in sorted(solutions_dir.glob("*.ipynb")):
        try:
            planned[path.name] = exercise_notebook(read_notebook(path), repo_url, path.stem)
        except (NotebookReadError, ValueError) as exc:
            problems.append(f"{path}: {exc}")
    if problems:
        raise ReleaseError(problems)
    return planned


def release(solutions_dir: pathlib.Path, exercises_dir: pathlib.Path, repo_url: str) -> list[str]:
    """Regenerate `exercises_dir` from `solutions_dir`; returns one line per file changed."""
    planned = plan_release(solutions_dir, repo_url)
    exercises_dir.mkdir(parents=True, exist_ok=True)
    changes = []
    for path in sorted(exercises_dir.glob("*.ipynb")):
        if path.name not in planned:
            path.unlink()
            changes.append(f"removed {path} (no source in {solutions_dir})")
    for name, text in {**planned, CONFTEST_NAME: CONFTEST}.items():
        path = exercises_dir / name
        data = text.encode("utf-8")
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
            changes.append(f"wrote {path}")
    return changes


VARIANT_LINE = "CLASS_SEED = {seed!r}  # this class's values: see minillm.course.variants\n"


def variant_exercise(text: str, seed: str) -> str:
    """A released exercise (notebook JSON text) whose checks draw from the class `seed`."""
    if not seed.strip():
        raise ValueError("a class seed must not be empty")
    nb = nbformat.reads(text, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and GRADED_RE.match(cell.source):
            # the points marker stays the first line: grading reads it there
            marker, _, rest = cell.source.partition("\n")
            cell.source = f"{marker}\n{VARIANT_LINE.format(seed=seed)}{rest}"
    return nbformat.writes(nb, version=4) + "\n"


_VARIANT_CALL = re.compile(r"\bvariant\(")


_CLASS_EXAMPLES = re.compile(r"^@class_examples\b", re.M)


def _check_sources(nb: nbformat.NotebookNode) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code" and GRADED_RE.match(c.source)]


def variant_checks(nb: nbformat.NotebookNode) -> tuple[int, int]:
    """(checks that draw class values through `variant`, all checks) of a notebook."""
    checks = _check_sources(nb)
    return sum(bool(_VARIANT_CALL.search(source)) for source in checks), len(checks)


def class_example_checks(nb: nbformat.NotebookNode) -> int:
    """Checks of a notebook whose Hypothesis examples come from the class seed in a
    private release (a test marked `@class_examples`)."""
    return sum(bool(_CLASS_EXAMPLES.search(source)) for source in _check_sources(nb))


def _tracked_by_git(out: pathlib.Path, solutions_dir: pathlib.Path) -> pathlib.Path | None:
    """The git repository holding `solutions_dir`, when files written to `out` would be
    tracked in it (inside it and not ignored); else None."""
    top = subprocess.run(
        ["git", "-C", str(solutions_dir), "rev-parse", "--show-toplevel"],
        capture_output=True,
        text=True,
    )
    if top.returncode != 0:
        return None  # not in a git repository: nothing would be committed
    root = pathlib.Path(top.stdout.strip()).resolve()
    out = out.resolve()
    if out != root and root not in out.parents:
        return None
    ignored = subprocess.run(
        ["git", "-C", str(root), "check-ignore", "-q", str(out / "probe.ipynb")],
        capture_output=True,
    )
    return None if ignored.returncode == 0 else root


def release_variant(
    solutions_dir: pathlib.Path, out: pathlib.Path, repo_url: str, seed: str
) -> list[str]:
    """Write the class `seed`'s private exercises into `out`; one line per file written,
    saying how many of its checks draw class values (the others are the public checks).

    Refuses a folder inside the solutions' git repository that git does not ignore: the
    private copy must never be committed beside the public edition.
    """
    root = _tracked_by_git(out, solutions_dir)
    if root is not None:
        raise ValueError(
            f"{out} is inside the repository {root} and not ignored by git: write a class's "
            "private exercises outside it, or into a folder listed in .gitignore"
        )
    planned = plan_release(solutions_dir, repo_url)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in {**planned, CONFTEST_NAME: CONFTEST}.items():
        path = out / name
        if name not in planned:
            path.write_text(text, encoding="utf-8")
            written.append(f"wrote {path}")
            continue
        path.write_text(variant_exercise(text, seed), encoding="utf-8")
        varied, checks = variant_checks(nbformat.reads(text, as_version=4))
        written.append(f"wrote {path}: {varied} of {checks} checks draw this class's values")
    return written


def stale_exercises(
    solutions_dir: pathlib.Path, exercises_dir: pathlib.Path, repo_url: str
) -> list[str]:
    """One line per exercise notebook that differs, is missing, or has no source."""
    planned = plan_release(solutions_dir, repo_url)
    stale = []
    for name, text in {**planned, CONFTEST_NAME: CONFTEST}.items():
        path = exercises_dir / name
        if not path.exists():
            stale.append(f"{path}: missing")
        elif path.read_bytes() != text.encode("utf-8"):
            source = f"its solution {solutions_dir / name}" if name in planned else "release's"
            stale.append(f"{path}: differs from {source}")
    for path in sorted(exercises_dir.glob("*.ipynb")):
        if path.name not in planned:
            stale.append(f"{path}: has no source in {solutions_dir}")
    return stale


def fix_ids(solutions_dir: pathlib.Path) -> list[pathlib.Path]:
    """Give the exercise cells of every solution notebook their stable ids.

    Returns the notebooks rewritten; notebooks that cannot be read or parsed are left for
    release to report.
    """
    changed = []
    for path in sorted(solutions_dir.glob("*.ipynb")):
        try:
            nb = read_notebook(path)
            if not assign_release_ids(nb):
                continue
        except (NotebookReadError, ValueError):
            continue
        path.write_text(nbformat.writes(nb, version=4) + "\n", encoding="utf-8")
        changed.append(path)
    return changed


def fix_bootstrap(solutions_dir: pathlib.Path, repo_url: str) -> list[pathlib.Path]:
    """Make the first cell of every solution notebook the current bootstrap cell.

    Replaces a bootstrap cell of another URL or version, or inserts one at the top.
    Returns the notebooks rewritten; notebooks that cannot be read are left for release
    to report.
    """
    changed = []
    for path in sorted(solutions_dir.glob("*.ipynb")):
        try:
            nb = read_notebook(path)
        except NotebookReadError:
            continue
        if nb.cells and is_bootstrap_cell(nb.cells[0], repo_url):
            continue
        cell = bootstrap_cell(repo_url)
        if nb.cells and looks_like_bootstrap_cell(nb.cells[0]):
            cell.id = nb.cells[0].get("id", cell.id)
            nb.cells[0] = cell
        else:
            nb.cells.insert(0, cell)
        path.write_text(nbformat.writes(nb, version=4) + "\n", encoding="utf-8")
        changed.append(path)
    return changed


def execute_solutions(paths: list[pathlib.Path], timeout_s: int) -> list[str]:
    """Run each solution notebook and store its outputs; returns one line per failure.

    A notebook with a cell that raises is not written.
    """
    failures = []
    for path in paths:
        nb = read_notebook(path)
        # Keep the stored metadata: the kernel would add its own Python version.
        metadata = copy.deepcopy(nb.metadata)
        errors = execute_notebook(nb, path.resolve().parent, timeout_s)
        nb.metadata = metadata
        failed = {i: e for i, e in errors.items() if e is not None}
        if failed:
            failures.extend(f"{path}, cell {i}: {e}" for i, e in sorted(failed.items()))
            continue
        path.write_text(nbformat.writes(nb, version=4) + "\n", encoding="utf-8")
    return failures


def find_root(start: pathlib.Path) -> pathlib.Path:
    """The nearest folder at or above `start` that holds `pyproject.toml`."""
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    raise FileNotFoundError(
        f"no pyproject.toml at or above {start}: run inside the repository, "
        "or pass --solutions, --exercises and --config"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "exercises", help="release exercise notebooks from their solutions, or check them"
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    release_parser = actions.add_parser(
        "release",
        help="regenerate exercises/ from solutions/",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    release_parser.add_argument(
        "--fix-ids",
        action="store_true",
        help="first give each solution's exercise cells the ids derived from their names",
    )
    release_parser.add_argument(
        "--fix-bootstrap",
        action="store_true",
        help="first rewrite each solution so that its first cell is the current bootstrap",
    )
    release_parser.add_argument(
        "--seed",
        metavar="S",
        help="write a class's private variant, drawn from the secret S, into --out "
        "(exercises/ is left alone)",
    )
    release_parser.add_argument(
        "--out", type=pathlib.Path, metavar="DIR", help="with --seed: where the variant goes"
    )
    check_parser = actions.add_parser(
        "check", help="exit 1, naming the files, when exercises/ is out of date"
    )
    execute_parser = actions.add_parser(
        "execute", help="run solution notebooks and store their outputs"
    )
    execute_parser.add_argument(
        "notebooks", nargs="*", type=pathlib.Path, help="default: every solution notebook"
    )
    execute_parser.add_argument(
        "--timeout", type=int, default=DEFAULT_TIMEOUT_S, metavar="SECONDS", help="per cell"
    )
    for sub, func in ((release_parser, _release), (check_parser, _check)):
        sub.add_argument("--solutions", type=pathlib.Path, help="default: <repo>/solutions")
        sub.add_argument("--exercises", type=pathlib.Path, help="default: <repo>/exercises")
        sub.add_argument("--config", type=pathlib.Path, help="default: <repo>/_config.yml")
        sub.set_defaults(func=func)
    execute_parser.set_defaults(func=_execute)
    edition_parser = actions.add_parser(
        "student-edition",
        help="write the repository without solutions/ into OUT, for a class to clone",
        description=(
            "Copies the files git tracks into OUT, leaving out solutions/ and the tests "
            "that read it, then scans OUT for the code of every solution region; exits 1 "
            "when an answer shows up outside the engine."
        ),
    )
    edition_parser.add_argument("out", type=pathlib.Path, metavar="OUT")
    edition_parser.set_defaults(func=_student_edition)


def _folders(args: argparse.Namespace) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    if args.solutions and args.exercises and args.config:
        return args.solutions, args.exercises, args.config
    root = find_root(pathlib.Path.cwd())
    return (
        args.solutions or root / "solutions",
        args.exercises or root / "exercises",
        args.config or root / "_config.yml",
    )


def _fail(message: str) -> int:
    print(f"minillm exercises: {message}", file=sys.stderr)
    return 1


def _release(args: argparse.Namespace) -> int:
    try:
        solutions, exercises, config = _folders(args)
        repo_url = repository_url(config)
        if (args.seed is None) != (args.out is None):
            return _fail("--seed and --out go together: a class's variant needs both")
        if args.fix_bootstrap:
            for path in fix_bootstrap(solutions, repo_url):
                print(f"updated the bootstrap cell of {path}")
        if args.fix_ids:
            for path in fix_ids(solutions):
                print(f"gave the exercise cells of {path} their ids")
        if args.seed is not None:
            print("\n".join(release_variant(solutions, args.out, repo_url, args.seed)))
            return 0
        changes = release(solutions, exercises, repo_url)
    except ReleaseError as exc:
        return _fail(f"no exercise written:\n{exc}")
    except (FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    print("\n".join(changes) if changes else f"{exercises} is up to date")
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        solutions, exercises, config = _folders(args)
        stale = stale_exercises(solutions, exercises, repository_url(config))
    except (ReleaseError, FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    for line in stale:
        print(f"stale: {line}", file=sys.stderr)
    if stale:
        print("run `minillm exercises release` to regenerate them", file=sys.stderr)
        return 1
    print(f"{exercises} is up to date with {solutions}")
    return 0


def _execute(args: argparse.Namespace) -> int:
    try:
        paths = args.notebooks or sorted(
            (find_root(pathlib.Path.cwd()) / "solutions").glob("*.ipynb")
        )
        failures = execute_solutions(paths, args.timeout)
    except (FileNotFoundError, NotebookReadError) as exc:
        return _fail(str(exc))
    for line in failures:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failures else 0


def _student_edition(args: argparse.Namespace) -> int:
    from minillm.course.student_edition import write_student_edition

    try:
        edition = write_student_edition(find_root(pathlib.Path.cwd()), args.out)
    except (FileNotFoundError, ValueError, NotebookReadError) as exc:
        return _fail(str(exc))
    for line in edition.left_out:
        print(f"left out {line}")
    for line in edition.in_engine:
        print(f"in the engine the checks compare against: {line}")
    for line in edition.leaks:
        print(f"answer found: {line}", file=sys.stderr)
    if edition.leaks:
        return _fail(f"{args.out} shows answers: do not publish it")
    print(f"wrote the student edition to {args.out}: start its history with `git init`")
    return 0
