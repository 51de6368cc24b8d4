"""A class's private release of the chapters whose checks draw their worked examples
through `variant` grades with other values than the public edition.

The cheat is the one a public worked example invites: an answer that returns the value
the public check expects for its worked example (the first call the check makes). On
each check that draws its worked example through `variant`, it scores nothing on a
class's private release, where the worked example's input is drawn
from the class seed; the solutions score full marks there. Two class seeds take the
chapters in turn, so that each chapter is graded once.

Grading is slow, so the private reference keeps the checks that draw through `variant`
(a representative subset of each chapter, and every chapter that draws) and answers the
others with a check that passes.
"""

from __future__ import annotations

import math
import pathlib
import re
import shutil

import nbformat
import pytest
import torch
from IPython.core.inputtransformer2 import TransformerManager

from minillm.course.bootstrap import repository_url
from minillm.course.exercise_model import parse_exercises
from minillm.course.exercises import release_variant
from minillm.course.grading import grade_notebooks
from minillm.course.notebook_io import GRADED_RE

from .conftest import write_notebook

ROOT = pathlib.Path(__file__).resolve().parents[2]
# chapter: how many of its checks draw a worked example through variant
CHAPTERS = {
    "ch00_conventions": 5,
    "ch01_request_journey": 8,
    "ch02_roofline": 4,
    "ch03_kv_cache": 2,
    "ch04_scheduling": 3,
    "ch05_kernels": 3,
    "ch06_quantization": 5,
    "ch07_decoding": 4,
    "ch08_distributed": 2,
    "ch09_metrics": 4,
}
SEEDS = ["fall-27", "spring-term-7"]  # two classes: the tests' own seeds, not a class's secret
VARIANT_CALL = re.compile(r"\bvariant\(")  # a call of variant, not of hypothesis's invariant


def draws(source: str) -> bool:
    """Whether a check draws a worked example through variant."""
    return bool(VARIANT_CALL.search(source))


def run_cell(source: str, namespace: dict) -> None:
    """A notebook cell's source, IPython syntax (the bootstrap's %pip) included."""
    exec(compile(TransformerManager().transform_cell(source), "<cell>", "exec"), namespace)


def recorded_answers(chapter: str) -> dict[str, list]:
    """{function: [result, ...]} of every call the public checks that draw through variant
    make of the solution."""
    nb = nbformat.read(ROOT / "solutions" / f"{chapter}.ipynb", as_version=4)
    exercises = parse_exercises(nb)
    functions = {name for e in exercises.exercises if draws(e.check_source) for name in e.functions}
    checks = {e.check_cell for e in exercises.exercises}
    varied = {e.check_cell for e in exercises.exercises if draws(e.check_source)}
    namespace: dict = {}
    tables: dict[str, list] = {name: [] for name in functions}

    def recording(name, fn):
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            tables[name].append(result)
            return result

        return call

    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if i in checks and i not in varied:
            continue  # only the checks that draw through variant are asked
        if i in checks:
            run_cell(
                cell.source,
                {
                    **namespace,
                    **{n: recording(n, namespace[n]) for n in functions if n in namespace},
                },
            )
        else:
            run_cell(cell.source, namespace)
    return tables


def literal(value) -> str:
    """Python source that rebuilds `value`: its repr, with each tensor typed in as
    `torch.tensor(values, dtype=...)` (a tensor's repr is no expression)."""
    if isinstance(value, torch.Tensor):
        return f"torch.tensor({value.tolist()!r}, dtype={value.dtype})"
    if isinstance(value, tuple):
        return f"({''.join(literal(v) + ', ' for v in value)})"
    if isinstance(value, list):
        return f"[{', '.join(literal(v) for v in value)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{literal(k)}: {literal(v)}' for k, v in value.items())}}}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    return repr(value)


def hard_coded_notebook(chapter: str, tables: dict[str, list]) -> nbformat.NotebookNode:
    """The released notebook answered with the public worked examples' expected values."""
    nb = nbformat.read(ROOT / "exercises" / f"{chapter}.ipynb", as_version=4)
    exercises = parse_exercises(nbformat.read(ROOT / "solutions" / f"{chapter}.ipynb", 4))
    for exercise in exercises.exercises:
        if not draws(exercise.check_source):
            continue  # left unanswered
        [answer_id] = exercise.answer_ids
        [cell] = [c for c in nb.cells if c.get("id") == answer_id]
        cell.source = "import torch\n\n\n" + "\n\n".join(
            # the worked example comes first
            f"def {name}(*args, **kwargs):\n    return {literal((tables[name] or [None])[0])}\n"
            for name in exercise.functions
        )
    return nb


def varied_only(private: pathlib.Path) -> None:
    """Keep the private release's checks that draw through variant; every other check
    passes as it stands (the representative subset, graded in a fraction of the time)."""
    nb = nbformat.read(private, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and GRADED_RE.match(cell.source) and not draws(cell.source):
            marker, _, _ = cell.source.partition("\n")
            cell.source = f"{marker}\npass\n"
    nbformat.write(nb, private)


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_private_release_rejects_the_public_values_and_accepts_the_solution(tmp_path, chapter):
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    shutil.copy(ROOT / "solutions" / f"{chapter}.ipynb", solutions)
    hard_coded = write_notebook(
        tmp_path / "hard_coded" / f"{chapter}.ipynb",
        hard_coded_notebook(chapter, recorded_answers(chapter)),
    )
    solution = ROOT / "solutions" / f"{chapter}.ipynb"
    # one class per chapter, the two classes in turn: each seed grades half the chapters
    for seed in [SEEDS[list(CHAPTERS).index(chapter) % len(SEEDS)]]:
        release_variant(solutions, tmp_path / seed, repository_url(ROOT / "_config.yml"), seed)
        private = tmp_path / seed / f"{chapter}.ipynb"
        checks = parse_exercises(nbformat.read(private, as_version=4)).exercises
        varied = [e.name for e in checks if draws(e.check_source)]
        assert len(varied) == CHAPTERS[chapter]
        varied_only(private)

        [private_hard_coded, private_solution], problems = grade_notebooks(
            [hard_coded, solution], reference=private, jobs=2
        )
        assert problems == []
        assert private_solution.points == private_solution.max_points, [
            (seed, e.name, e.error) for e in private_solution.exercises if not e.passed
        ]
        passed = [e.name for e in private_hard_coded.exercises if e.name in varied and e.passed]
        assert passed == [], seed


# checks whose Hypothesis tests keep the public examples in a private release for now
UNSEEDED = {
    ("ch05_kernels", "online_attention"),
}
HYPOTHESIS_TEST = re.compile(r"^@(?:settings\(|CHECK\b)|^class \w+\(RuleBasedStateMachine\)", re.M)
CLASS_EXAMPLES = re.compile(r"^@class_examples\n(?=@(?:settings\(|CHECK\b)|class )", re.M)


SOLUTIONS = sorted((ROOT / "solutions").glob("ch*.ipynb"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_every_hypothesis_test_of_a_check_draws_its_examples_from_the_class_seed(path):
    exercises = parse_exercises(nbformat.read(path, as_version=4)).exercises
    unseeded = [
        e.name
        for e in exercises
        if len(HYPOTHESIS_TEST.findall(e.check_source))
        != len(CLASS_EXAMPLES.findall(e.check_source))
    ]
    assert unseeded == sorted(name for chapter, name in UNSEEDED if chapter == path.stem)
