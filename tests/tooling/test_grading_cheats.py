"""The known ways to cheat `minillm grade`, each of which must score zero on what it touches.

Each cheat is a submission of the fixture below: exercise 1 (`weight_bytes_bf16`, 2 points)
answered with a wrong, hard-coded value plus the trick, and exercise 2 (`square`, 1 point)
answered right unless the trick is aimed at it. All are graded in one run against the
solution notebook, so that a cheat that reads the reference would find the answers there.
"""

from __future__ import annotations

import os
import pathlib
import platform
import sys

import pytest

from minillm.course.grading import grade_notebooks
from minillm.course.sandbox import landlock_abi, pids_cgroup
from minillm.lab import units

from .conftest import code, filled, md, released_fixture, write_notebook

SETUP = """from minillm.lab import units

EXAMPLES = [(8_030_000_000, 16_060_000_000)]


def reference_weight_bytes(n):
    return units.weight_bytes(n, "bfloat16")"""

CHECK_1 = """# GRADED: 2 points
from hypothesis import given, settings
from hypothesis import strategies as st

for n, expected in EXAMPLES:
    assert weight_bytes_bf16(n) == expected


@settings(max_examples=20, derandomize=True, database=None, deadline=None)
@given(st.integers(0, 10**12))
def check(n):
    assert weight_bytes_bf16(n) == reference_weight_bytes(n)


check()"""

CHECK_2 = """# GRADED: 1 point
import math

assert math.isclose(square(1.5), 2.25)
assert square(4) == 16"""

CELLS = [
    md("# Cheats"),
    code(SETUP, "setup"),
    md("## Exercise 1: weight bytes (2 points)"),
    code(
        "def weight_bytes_bf16(n):\n    ### BEGIN SOLUTION\n    return 2 * n\n    ### END SOLUTION",
        "weight_bytes_bf16",
    ),
    code(CHECK_1, "weight_bytes_bf16-check"),
    md("## Exercise 2: square (1 point)"),
    code(
        "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION", "square"
    ),
    code(CHECK_2, "square-check"),
]

HARD_CODED = "return 16_060_000_000"
SQUARE = "return x * x"
PACKAGE_FILE = pathlib.Path(units.__file__).with_name("written_by_a_submission.txt")

# name -> (answers, the cell source to append to the answer cells or None, expected scores)
CHEATS = {
    "IPython input transformer": (
        {},
        "get_ipython().input_transformers_cleanup.append(\n"
        "    lambda lines: [\"print('passed')\\n\"] if '# GRADED' in ''.join(lines) else lines\n"
        ")",
        {"weight_bytes_bf16": 0, "square": 0},
    ),
    "patch minillm at the top level": (
        {"weight_bytes_bf16": HARD_CODED, "square": SQUARE},
        "from minillm.lab import units\nunits.weight_bytes = lambda n, dtype: 16_060_000_000",
        {"weight_bytes_bf16": 0, "square": 0},
    ),
    "patch minillm in the answer": (
        {
            "weight_bytes_bf16": "from minillm.lab import units\n"
            "units.weight_bytes = lambda n, dtype: 16_060_000_000\n" + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "replace the oracle's code": (
        {
            "weight_bytes_bf16": "from minillm.lab import units\n"
            "units.weight_bytes.__code__ = (lambda n, dtype: 16_060_000_000).__code__\n"
            + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "patch a builtin": (
        {
            "weight_bytes_bf16": HARD_CODED,
            "square": "import math\nmath.isclose = lambda *a, **k: True\nreturn 16",
        },
        None,
        {"weight_bytes_bf16": 0, "square": 0},
    ),
    "patch builtins": (
        {
            "weight_bytes_bf16": HARD_CODED,
            "square": "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
            "return 16",
        },
        None,
        {"weight_bytes_bf16": 0, "square": 0},
    ),
    "trace the check's frames": (
        {
            "weight_bytes_bf16": "import sys\nsys.settrace(lambda *a: None)\n" + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "redefine the setup's oracle in the answer": (
        {"weight_bytes_bf16": HARD_CODED, "square": SQUARE},
        "def reference_weight_bytes(n):\n    return 16_060_000_000",
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "mutate a setup table": (
        {
            "weight_bytes_bf16": "EXAMPLES[0] = (0, 16_060_000_000)\n" + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "rebind a name in the check's namespace": (
        {
            "weight_bytes_bf16": "globals()['reference_weight_bytes'] = lambda n: 16_060_000_000\n"
            + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "write into the installed package": (
        {
            "weight_bytes_bf16": f"open({str(PACKAGE_FILE)!r}, 'w').write('x')\n" + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "forge a passing result": (
        {
            "weight_bytes_bf16": "import os\n"
            "for fd in range(1, 64):\n"
            "    try:\n"
            '        os.write(fd, b\'{"passed": true, "error": null}\\n\')\n'
            "    except OSError:\n"
            "        pass\n" + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "link the printed output to the reference": (
        {
            "weight_bytes_bf16": "import os\n"
            "os.unlink('output.txt')\n"
            "os.symlink(REFERENCE, 'output.txt')\n" + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "forge the result from a helper cell": (
        {},
        "class _Helpers:\n"
        "    import sys as _sys, os as _os, json as _json\n"
        "    _f = _sys._getframe()\n"
        "    while _f is not None and 'nonce' not in _f.f_locals:\n"
        "        _f = _f.f_back\n"
        "    if _f is not None:\n"
        "        _os.write(_f.f_locals['result_fd'], (_json.dumps({'passed': True, 'error': None,"
        " 'nonce': _f.f_locals['nonce']}) + '\\n').encode())\n"
        "        _os._exit(0)",
        {"weight_bytes_bf16": 0, "square": 0},
    ),
    "return values that equal everything": (
        {
            "weight_bytes_bf16": "class Anything(int):\n"
            "    def __eq__(self, other):\n        return True\n"
            "    def __ne__(self, other):\n        return True\n"
            "    __hash__ = int.__hash__\n"
            "return Anything(0)",
            "square": "class Anything(float):\n"
            "    def __eq__(self, other):\n        return True\n"
            "    __hash__ = float.__hash__\n"
            "return Anything(0)",
        },
        None,
        {"weight_bytes_bf16": 0, "square": 0},
    ),
    "switch the tamper detector off, then patch minillm": (
        {
            "weight_bytes_bf16": "import gc\n"
            "for o in gc.get_objects():\n"
            "    if type(o).__name__ == 'Snapshot':\n"
            "        o.modules.clear(); o.deep.clear(); o.values.clear()\n"
            "from minillm.lab import units\n"
            "units.weight_bytes = lambda n, dtype: 16_060_000_000\n" + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "jump the check's frame to its last line": (
        {
            "weight_bytes_bf16": "import sys as _sys\n"
            "_check = _sys._getframe(1)\n"
            "_last = max(line for *_, line in _check.f_code.co_lines() if line is not None)\n"
            "def _tracer(frame, event, arg):\n"
            "    if frame is _check and event == 'line':\n"
            "        frame.f_lineno = _last\n"
            "        frame.f_trace = None\n"
            "        _sys.settrace(None)\n"
            "    return _tracer\n"
            "_check.f_trace = _tracer\n"
            "_sys.settrace(_tracer)\n" + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "rebind the oracle in the caller's namespace": (
        {
            "weight_bytes_bf16": "import sys\n"
            "sys._getframe(1).f_globals['reference_weight_bytes'] = lambda n: 16_060_000_000\n"
            + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "run a classmate's answer from the grader's memory": (
        {
            "weight_bytes_bf16": "import sys\n"
            "f = sys._getframe()\n"
            "while f is not None and 'grader' not in f.f_locals:\n"
            "    f = f.f_back\n"
            "for sub in f.f_locals['grader'].job['submissions'] if f else []:\n"
            "    for cell in sub.get('cells', []):\n"
            "        if 'return 2 * n' in cell['source']:\n"
            "            scope = {}\n"
            "            exec(cell['source'], scope)\n"
            "            return scope['weight_bytes_bf16'](n)",
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "answer with the check's oracle": (
        {"weight_bytes_bf16": "return reference_weight_bytes(n)", "square": SQUARE},
        None,
        {"weight_bytes_bf16": 2, "square": 1},
    ),
    "an honest classmate": (
        {"weight_bytes_bf16": "return 2 * n", "square": SQUARE},
        None,
        {"weight_bytes_bf16": 2, "square": 1},
    ),
    "leave before the check fails": (
        {"weight_bytes_bf16": "raise SystemExit(0)", "square": "import os\nos._exit(0)"},
        None,
        {"weight_bytes_bf16": 0, "square": 0},
    ),
}

# these need Landlock: without it, the kernel lets the process do what its user may
CONFINED = {
    "read the reference": (
        {
            # the solution notebook holds the answer: run its cell
            "weight_bytes_bf16": "import json\n"
            "nb = json.load(open(REFERENCE))\n"
            "cell = [c for c in nb['cells'] if c.get('id') == 'weight_bytes_bf16'][0]\n"
            "scope = {}\n"
            "exec(''.join(cell['source']), scope)\n"
            "return scope['weight_bytes_bf16'](n)",
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "read a classmate's cells": (
        {
            "weight_bytes_bf16": "import glob, json, os\n"
            "for path in glob.glob(os.path.join(os.getcwd(), '..', 'cells-*.json')):\n"
            "    for cell in json.load(open(path)):\n"
            "        if 'return 2 * n' in cell['source']:\n"
            "            scope = {}\n"
            "            exec(cell['source'], scope)\n"
            "            return scope['weight_bytes_bf16'](n)\n"
            "os.listdir('..')",
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
    "kill the grader": (
        {
            "weight_bytes_bf16": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
            + HARD_CODED,
            "square": SQUARE,
        },
        None,
        {"weight_bytes_bf16": 0, "square": 1},
    ),
}


# honest answers that run in Jupyter, as whole answer cells: each must score full points,
# unflagged
HONEST = {
    "a constant computed by a call": "import math\n\nBYTES_PER_BF16 = math.ceil(16 / 8)\n\n\n"
    "def weight_bytes_bf16(n):\n    return BYTES_PER_BF16 * n",
    "a guarded import": "try:\n    from minillm.lab.units import GiB\nexcept ImportError:\n"
    "    GiB = 2**30\n\n\ndef weight_bytes_bf16(n):\n    return 2 * n * GiB // GiB",
    "a %%time cell": "%%time\ndef weight_bytes_bf16(n):\n    return 2 * n\n\n\n"
    "print(weight_bytes_bf16(3))",
}
# graded apart: the grading process imports torch first for it, which slows every check
TORCH_ANSWER = (
    "import torch\n\n\ndef weight_bytes_bf16(n):\n"
    "    return n * torch.finfo(torch.bfloat16).bits // 8"
)

# what the student's process may do, printed by an answer that is right
PROBE = """import os, resource, socket
print('secret' if 'HF_TOKEN' in os.environ else 'no secret')
for name in ('RLIMIT_DATA', 'RLIMIT_FSIZE', 'RLIMIT_CPU', 'RLIMIT_NPROC', 'RLIMIT_CORE'):
    print(name, resource.getrlimit(getattr(resource, name))[0] != resource.RLIM_INFINITY)
for family, kind in ((socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_INET6, socket.SOCK_STREAM)):
    try:
        socket.socket(family, kind).close()
        print('network open')
    except PermissionError:
        print('network closed')
return x * x"""


def edited_setup(released: pathlib.Path, keep_ids: bool):
    """A submission whose setup cell makes the oracle agree with any answer."""
    nb = filled(released, {"weight_bytes_bf16": "return 3 * n", "square": SQUARE})
    nb.cells[2].source = "def reference_weight_bytes(n):\n    return weight_bytes_bf16(n)"
    if not keep_ids:
        for i, cell in enumerate(nb.cells):
            cell.id = f"lost-{i}"
    return nb


@pytest.fixture(scope="module")
def cheats(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cheats")
    released = released_fixture(root, CELLS)
    reference = root / "solutions" / "ex.ipynb"
    cases = dict(CHEATS)
    if landlock_abi() >= 6:
        cases.update(CONFINED)
    paths, expected = [], {}
    for name, (answers, extra, scores) in cases.items():
        answers = {k: v.replace("REFERENCE", repr(str(reference))) for k, v in answers.items()}
        nb = filled(released, answers)
        if extra is not None:
            nb.cells.insert(4, code(extra))
        paths.append(write_notebook(root / "class" / f"{len(paths)}.ipynb", nb))
        expected[name] = scores
    for name, source in HONEST.items():
        nb = filled(released, {"square": SQUARE})
        [cell] = [c for c in nb.cells if c.get("id") == "weight_bytes_bf16"]
        cell.source = source
        paths.append(write_notebook(root / "class" / f"{len(paths)}.ipynb", nb))
        expected[name] = {"weight_bytes_bf16": 2, "square": 1}
    nb = filled(released, {"square": PROBE})
    paths.append(write_notebook(root / "class" / f"{len(paths)}.ipynb", nb))
    expected["probe the limits"] = {"weight_bytes_bf16": 0, "square": 1}
    for keep_ids in (True, False):
        name = f"edit a setup cell ({'ids kept' if keep_ids else 'ids lost'})"
        nb = edited_setup(released, keep_ids)
        paths.append(write_notebook(root / "class" / f"{len(paths)}.ipynb", nb))
        expected[name] = {"weight_bytes_bf16": 0, "square": 1}
    before = {p: p.read_bytes() for p in root.rglob("*.ipynb")}
    os.environ["HF_TOKEN"] = "a secret the grader must not pass on"
    try:
        grades, problems = grade_notebooks(paths, reference, timeout_s=60, jobs=2)
    finally:
        del os.environ["HF_TOKEN"]
        written = PACKAGE_FILE.exists()
        PACKAGE_FILE.unlink(missing_ok=True)
    assert problems == []
    after = {p: p.read_bytes() for p in root.rglob("*.ipynb")}
    return {
        "grades": dict(zip(expected, grades, strict=True)),
        "expected": expected,
        "package_written": written,
        "notebooks_unchanged": before == after,
    }


CASES = [
    *CHEATS,
    "edit a setup cell (ids kept)",
    "edit a setup cell (ids lost)",
    *CONFINED,
    *HONEST,
    "probe the limits",
]


@pytest.mark.parametrize("name", CASES)
def test_a_cheat_scores_zero_on_what_it_touches(cheats, name):
    if name not in cheats["grades"]:
        pytest.skip("needs Linux Landlock (ABI 6)")
    grade = cheats["grades"][name]
    assert grade.error is None
    assert {e.name: e.points for e in grade.exercises} == cheats["expected"][name]


FLAGGED = {
    "forge the result from a helper cell": ("weight_bytes_bf16", "reads the call stack"),
    "return values that equal everything": ("square", "overrides equality"),
    "switch the tamper detector off, then patch minillm": ("weight_bytes_bf16", "walks the heap"),
    "jump the check's frame to its last line": ("weight_bytes_bf16", "traces execution"),
    "rebind the oracle in the caller's namespace": ("weight_bytes_bf16", "reads the call stack"),
    "run a classmate's answer from the grader's memory": (
        "weight_bytes_bf16",
        "reads the call stack",
    ),
}


@pytest.mark.parametrize("name", FLAGGED)
def test_a_cheat_is_flagged_for_the_instructor(cheats, name):
    exercise_name, what = FLAGGED[name]
    grade = cheats["grades"][name]
    [exercise] = [e for e in grade.exercises if e.name == exercise_name]
    assert any(what in flag for flag in exercise.flags), exercise.flags
    assert exercise.points == 0


def test_an_answer_that_calls_the_oracle_is_flagged(cheats):
    [flag] = cheats["grades"]["answer with the check's oracle"].exercises[0].flags
    assert flag == "calls what the check compares with: reference_weight_bytes"


@pytest.mark.parametrize("name", ["an honest classmate", *HONEST])
def test_an_honest_answer_is_not_flagged(cheats, name):
    grade = cheats["grades"][name]
    assert grade.all_flags() == []
    assert all(not e.error or "Tampering" not in e.error for e in grade.exercises)


def test_importing_torch_is_not_tampering(tmp_path):
    released = released_fixture(tmp_path, CELLS)
    nb = filled(released, {"square": SQUARE})
    [cell] = [c for c in nb.cells if c.get("id") == "weight_bytes_bf16"]
    cell.source = TORCH_ANSWER
    path = write_notebook(tmp_path / "class" / "torch.ipynb", nb)
    [grade], problems = grade_notebooks([path], tmp_path / "solutions" / "ex.ipynb")
    assert problems == []
    assert [e.points for e in grade.exercises] == [2, 1], grade.exercises[0].error


def test_the_students_process_is_limited(cheats):
    output = cheats["grades"]["probe the limits"].exercises[1].output
    missing = " ".join(cheats["grades"]["probe the limits"].limits_not_applied)
    held = os.geteuid() != 0 or pids_cgroup() is not None  # root, in a `pids` cgroup
    assert ("RLIMIT_NPROC" in missing) == (not held), missing
    assert "no secret" in output
    for name in ("RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_CORE"):
        assert f"{name} True" in output
    if platform.machine() in ("x86_64", "aarch64") and sys.platform.startswith("linux"):
        assert "network closed" in output and "network open" not in output, output


def test_tampering_is_named(cheats):
    grades = cheats["grades"]
    error = grades["patch minillm in the answer"].exercises[0].error
    assert error == (
        "Tampering: your code changed minillm.lab.units.weight_bytes, which the checks rely on"
    )
    assert (
        "minillm.lab.units.weight_bytes" in grades["replace the oracle's code"].exercises[0].error
    )
    assert "math.isclose" in grades["patch a builtin"].exercises[1].error
    assert "builtins.AssertionError" in grades["patch builtins"].exercises[1].error
    assert "interpreter's hooks" in grades["trace the check's frames"].exercises[0].error
    assert "EXAMPLES" in grades["mutate a setup table"].exercises[0].error


def test_a_hard_coded_answer_fails_on_hypothesiss_input(cheats):
    exercise = cheats["grades"]["redefine the setup's oracle in the answer"].exercises[0]
    assert exercise.input == "check(n=0)"
    assert exercise.checked == "assert weight_bytes_bf16(n) == reference_weight_bytes(n)"
    assert exercise.error == (
        "AssertionError: weight_bytes_bf16(n) == reference_weight_bytes(n) is false: "
        "weight_bytes_bf16(n) = 16060000000, reference_weight_bytes(n) = 0"
    )


def test_the_grader_reads_back_only_what_was_printed(cheats):
    exercise = cheats["grades"]["link the printed output to the reference"].exercises[0]
    assert "BEGIN SOLUTION" not in exercise.output


def test_a_redefined_setup_name_is_pointed_out(cheats):
    [note] = cheats["grades"]["redefine the setup's oracle in the answer"].exercises[0].notes
    assert note.startswith("your code defines reference_weight_bytes, which the notebook's setup")
    [note] = cheats["grades"]["edit a setup cell (ids kept)"].notes
    assert note.startswith("cell 2 differs from the reference's")


@pytest.mark.skipif(landlock_abi() < 6, reason="needs Linux Landlock (ABI 6)")
def test_confined_cheats_fail_on_the_kernels_refusal(cheats):
    grades = cheats["grades"]
    assert not cheats["package_written"]
    assert cheats["notebooks_unchanged"]
    error = grades["write into the installed package"].exercises[0].error
    assert error.startswith("PermissionError: [Errno 13] Permission denied")
    assert grades["read the reference"].exercises[0].error.startswith("PermissionError")
    assert grades["kill the grader"].exercises[0].error.startswith("PermissionError")
