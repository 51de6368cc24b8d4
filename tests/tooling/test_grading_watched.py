"""Checks that watch the student's code at work run in the check's process.

Such a check used to run in the student's process, where the student's code could answer
the check's request itself: find the socket's `Connection` on the heap, send "passed" and
exit. Now the check lends the student's code its own instruments (`lend`: the model, the
engine, the clock, the kernel's launcher are the check's, so each call is seen where the
student's code cannot reach) and only what a torch function mode must see from inside runs
there (`watch`), for one assertion of one exercise, which the grader flags.
"""

from __future__ import annotations

import pathlib

import nbformat
import pytest

from minillm.course.grading import grade_notebooks
from minillm.course.notebook_io import GRADED_RE

from .conftest import write_notebook

ROOT = pathlib.Path(__file__).resolve().parents[2]

# the old forgery: answer the check's pending request with a pass, from the student's process
FORGE = """
def _forge():
    import gc
    import os

    from minillm.course import remote

    for o in gc.get_objects():
        if type(o) is remote.Connection:
            o._send({"value": o.encode({"passed": True, "error": None}, [], {})}, [])
            os._exit(0)

"""

CH01 = {
    # the review's cheat: no decoding; the setup's oracle patched to agree, and the forward
    # calls the check counts made on zeros
    "generate_without_cache": """import torch


def generate_without_cache(model, prompt_ids, max_tokens):
    got = [0] * max_tokens

    class Output:
        pass

    def fake_generate(ids, params, use_tqdm=False):
        out = Output()
        out.outputs = [Output()]
        out.outputs[0].token_ids = got
        return [out]

    llm.generate = fake_generate
    with torch.inference_mode():
        for n in range(len(prompt_ids), len(prompt_ids) + max_tokens):
            model.forward_causal(torch.zeros((1, n), dtype=torch.long))
    return got
""",
    "time_next_token": FORGE
    + """
source_ids = list(range(1000))


def time_next_token(token_ids, use_cache):
    _forge()
    return 0.001
""",
}

CH05 = {
    "online_attention": FORGE
    + """
def online_attention(q, k, v, block_size):
    _forge()
""",
    "ops_per_decode_step": FORGE
    + """
def ops_per_decode_step(engine):
    _forge()


def fixed_cost_s(times_s):
    _forge()


def best_step_time_s(engine, num_steps):
    _forge()


def fixed_cost_share(num_ops, op_cost_s, step_time_s):
    _forge()
""",
    "silu_mul_kernel": FORGE
    + """import triton
import triton.language as tl


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pass


def silu_mul(gate, up, block=128):
    _forge()
""",
}


def submission(tmp_path: pathlib.Path, chapter: str, answers: dict[str, str]) -> pathlib.Path:
    nb = nbformat.read(ROOT / "exercises" / chapter, as_version=4)
    for name, source in answers.items():
        [cell] = [c for c in nb.cells if c.get("id") == name]
        cell.source = source
    return write_notebook(tmp_path / f"cheat_{chapter}", nb)


def graded(tmp_path, chapter, answers):
    path = submission(tmp_path, chapter, answers)
    [grade], problems = grade_notebooks([path], reference=ROOT / "exercises", jobs=2)
    assert problems == []
    return {e.name: e for e in grade.exercises}


@pytest.mark.slow
def test_chapter_1s_watched_checks_cannot_be_forged(tmp_path):
    exercises = graded(tmp_path, "ch01_request_journey.ipynb", CH01)
    for name in CH01:
        assert exercises[name].points == 0, (name, exercises[name].error)
        assert exercises[name].flags, name
        assert not exercises[name].in_student_process, name


# no decoding: the check's own model, lent (the very one its engine runs), zeroed through a
# public method, so that an engine asked afterwards answers token 0 every time
ZEROED_MODEL = """import torch


def generate_without_cache(model, prompt_ids, max_tokens):
    state = model.state_dict()
    model.load_state_dict({name: torch.zeros_like(t) for name, t in state.items()})
    with torch.inference_mode():
        for n in range(len(prompt_ids), len(prompt_ids) + max_tokens):
            model.forward_causal(torch.zeros((1, n), dtype=torch.long))
    return [0] * max_tokens
"""


@pytest.mark.slow
def test_a_lent_model_changed_does_not_change_the_engines_answer(tmp_path):
    """The check asks its engine before it lends the model, so the answers it compares
    with are the untouched model's."""
    reference = only_check(tmp_path, "ch01_request_journey", "generate_without_cache")
    path = submission(
        tmp_path, "ch01_request_journey.ipynb", {"generate_without_cache": ZEROED_MODEL}
    )
    [grade], problems = grade_notebooks([path], reference=reference, jobs=1)
    assert problems == []
    [exercise] = [e for e in grade.exercises if e.name == "generate_without_cache"]
    assert exercise.points == 0 and "you gave [0, 0, 0" in exercise.error, exercise.error


@pytest.mark.slow
def test_chapter_5s_watched_checks_cannot_be_forged(tmp_path):
    exercises = graded(tmp_path, "ch05_kernels.ipynb", CH05)
    for name in CH05:
        assert exercises[name].points == 0, (name, exercises[name].error)
        assert exercises[name].flags, name
    assert not exercises["ops_per_decode_step"].in_student_process
    assert not exercises["silu_mul_kernel"].in_student_process


CH09 = {
    "send_on_schedule": FORGE
    + """
async def send_on_schedule(starts_s, send):
    _forge()
""",
}


@pytest.mark.slow
def test_chapter_9s_open_loop_check_cannot_be_forged(tmp_path):
    exercises = graded(tmp_path, "ch09_metrics.ipynb", CH09)
    assert exercises["send_on_schedule"].points == 0, exercises["send_on_schedule"].error
    assert exercises["send_on_schedule"].flags
    assert not exercises["send_on_schedule"].in_student_process


# a fixture: a setup object whose method the check counts through `lend`, and a question
# only the student's process can answer through `watch`
FIXTURE_SETUP = """import math


class Meter:
    def read(self, x):
        return math.sqrt(x)


meter = Meter()"""

FIXTURE_LEND = '''# GRADED: 2 points
from minillm.course.watching import lend

calls = []
real_read = meter.read
lend("meter", meter)
meter.read = lambda x: calls.append(x) or real_read(x)
try:
    assert roots([4, 9]) == [2.0, 3.0]
finally:
    del meter.read
assert calls == [4, 9], f"read the meter once per value: {calls}"'''

FIXTURE_WATCH = '''# GRADED: 1 point
from minillm.course.watching import watch

assert twice(2) == 4
assert watch("result = twice.__name__") == "twice"'''


def fixture_cells():
    from .conftest import code, md

    return [
        md("# Watched"),
        code(FIXTURE_SETUP, "setup"),
        md("## Exercise 1: roots (2 points)"),
        code(
            "def roots(xs):\n    ### BEGIN SOLUTION\n    return [meter.read(x) for x in xs]\n"
            "    ### END SOLUTION",
            "roots",
        ),
        code(FIXTURE_LEND, "roots-check"),
        md("## Exercise 2: twice (1 point)"),
        code(
            "def twice(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
            "twice",
        ),
        code(FIXTURE_WATCH, "twice-check"),
    ]


def test_a_lent_object_sees_the_students_calls_and_a_watched_check_is_flagged(tmp_path):
    from .conftest import filled, released_fixture

    released = released_fixture(tmp_path, fixture_cells())
    honest = write_notebook(
        tmp_path / "honest.ipynb",
        filled(released, {"roots": "return [meter.read(x) for x in xs]", "twice": "return 2 * x"}),
    )
    # the right values without the meter: the check's count, kept in its own process, is 0
    bypass = write_notebook(
        tmp_path / "bypass.ipynb",
        filled(released, {"roots": "return [x ** 0.5 for x in xs]", "twice": "return 2 * x"}),
    )
    [good, bad], problems = grade_notebooks([honest, bypass], reference=released)
    assert problems == []
    assert [e.passed for e in good.exercises] == [True, True]
    assert [e.in_student_process for e in good.exercises] == [False, True]
    assert not bad.exercises[0].passed and "once per value" in bad.exercises[0].error


# every ordinary way of reading the clock in Python, each a rewrite of the solution's
# `start = time.perf_counter()` ... `time.perf_counter() - start`
CLOCK_VARIANTS = {
    "time.perf_counter": ("", {}),
    "from time import perf_counter": (
        "from time import perf_counter\n",
        {"time.perf_counter()": "perf_counter()"},
    ),
    "import time as t": ("import time as t\n", {"time.perf_counter()": "t.perf_counter()"}),
    "from time import monotonic": (
        "from time import monotonic\n",
        {"time.perf_counter()": "monotonic()"},
    ),
    "time.perf_counter_ns": (
        "",
        {
            "start = time.perf_counter()": "start = time.perf_counter_ns()",
            "time.perf_counter() - start": "(time.perf_counter_ns() - start) / 1e9",
        },
    ),
    "time.time": ("", {"time.perf_counter()": "time.time()"}),
    "timeit.default_timer": (
        "from timeit import default_timer\n",
        {"time.perf_counter()": "default_timer()"},
    ),
    "time.clock_gettime(CLOCK_MONOTONIC)": (
        "",
        {"time.perf_counter()": "time.clock_gettime(time.CLOCK_MONOTONIC)"},
    ),
    "from time import clock_gettime_ns, CLOCK_REALTIME": (
        "from time import CLOCK_REALTIME, clock_gettime_ns\n",
        {
            "start = time.perf_counter()": "start = clock_gettime_ns(CLOCK_REALTIME)",
            "time.perf_counter() - start": "(clock_gettime_ns(CLOCK_REALTIME) - start) / 1e9",
        },
    ),
}
# what does not time the work: a made-up number after honest readings, and a clock that
# counts the CPU time of the student's process (the work runs in the check's)
CLOCK_CHEATS = {
    "a constant": ("", {"time.perf_counter() - start": "0 * (time.perf_counter() - start) + 0.01"}),
    "another clock": ("", {"time.perf_counter()": "time.process_time()"}),
    "a thread's CPU time": (
        "from time import thread_time\n",
        {"time.perf_counter()": "thread_time()"},
    ),
    "the process's CPU time by id": (
        "",
        {"time.perf_counter()": "time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)"},
    ),
}
# the CPU-time clocks, whose feedback says the question is about wall time
CPU_TIME = ("another clock", "a thread's CPU time", "the process's CPU time by id")
TIMED = {
    "ch01_request_journey": "time_next_token",
    "ch02_roofline": "fastest_decode_step_s",
    "ch05_kernels": "ops_per_decode_step",
}


def rewritten(tmp_path, chapter: str, cell_id: str, name: str, variant) -> pathlib.Path:
    prefix, replacements = variant
    nb = nbformat.read(ROOT / "solutions" / f"{chapter}.ipynb", as_version=4)
    [cell] = [c for c in nb.cells if c.get("id") == cell_id]
    source = cell.source
    for old, new in replacements.items():
        assert old in source, (chapter, name, old)
        source = source.replace(old, new)
    cell.source = prefix + source
    slug = "".join(ch if ch.isalnum() else "_" for ch in name)
    return write_notebook(tmp_path / chapter / f"{slug}.ipynb", nb)


def only_check(tmp_path, chapter: str, name: str) -> pathlib.Path:
    """The chapter's reference with every check but `name`'s answered by one that passes,
    so that grading nine notebooks costs nine runs of one check."""
    nb = nbformat.read(ROOT / "exercises" / f"{chapter}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and GRADED_RE.match(cell.source):
            if cell.get("id") != f"{name}-check":
                cell.source = cell.source.partition("\n")[0] + "\npass\n"
    return write_notebook(tmp_path / "reference" / f"{chapter}.ipynb", nb)


@pytest.mark.slow
@pytest.mark.parametrize("chapter", TIMED)
def test_every_way_of_reading_the_clock_is_graded_and_none_can_be_faked(tmp_path, chapter):
    cell_id = TIMED[chapter]
    cases = {**CLOCK_VARIANTS, **CLOCK_CHEATS}
    paths = [rewritten(tmp_path, chapter, cell_id, name, v) for name, v in cases.items()]
    reference = only_check(tmp_path, chapter, cell_id)
    grades, problems = grade_notebooks(paths, reference=reference, jobs=2)
    assert problems == []
    got = {}
    for name, grade in zip(cases, grades, strict=True):
        [exercise] = [e for e in grade.exercises if e.name == cell_id]
        got[name] = exercise.points if exercise.passed else (exercise.points, exercise.error)
        assert not exercise.in_student_process
    solution = grades[list(cases).index("time.perf_counter")]  # the solution as it is
    assert solution.points == solution.max_points, [e.error for e in solution.exercises]
    full = next(e.max_points for e in grades[0].exercises if e.name == cell_id)
    assert got == {**dict.fromkeys(CLOCK_VARIANTS, full), **{n: got[n] for n in CLOCK_CHEATS}}
    assert all(got[name][0] == 0 for name in CLOCK_CHEATS), got
    assert all("asks for wall time" in got[name][1] for name in CPU_TIME), got


CH08 = {
    "ring_all_reduce": FORGE
    + """
def ring_all_reduce(x, rank, world_size, send, recv):
    _forge()
""",
}

# the ranks' reply made up: each rank's sum and a ring's bytes, with nothing sent; then this
# thread answers the check's later requests itself, so that the check's verdict stands
FORGED_RING = """import gc
import sys
import time

import torch

from minillm.course import remote


def ring_all_reduce(x, rank, world_size, send, recv):
    if (rank, world_size) != (0, 2):
        time.sleep(60)
    frame = sys._getframe()
    while "ring_inputs" not in frame.f_globals:
        frame = frame.f_back
    threads = []
    for tensors in frame.f_globals["ring_inputs"]:
        p, total = len(tensors), torch.stack(tensors).sum(0)
        sent = 2 * (p - 1) * (total.numel() // p) * total.element_size()
        threads.append([(total.tolist(), list(total.shape), sent)] * p)
    reply = {"unchanged": True, "threads": threads}
    for o in gc.get_objects():
        if type(o) is remote.Connection:
            blobs = []
            o._send({"value": o.encode(reply, blobs, {})}, blobs)
            o.serve_forever()
"""

# zeros on the wire, and the check's expected messages rewritten to zeros through the
# globals of the check's function that the harness calls (asked for past `Remote`'s rules)
REACHED_IN = """import sys
import threading

import torch
import torch.distributed

from minillm.course import remote

inputs = {}


def ring_all_reduce(x, rank, world_size, send, recv):
    chunk = x.numel() // world_size
    lock = type(threading.Lock())
    turns = [c.cell_contents for c in send.__closure__ or () if type(c.cell_contents) is lock]
    if not turns:  # over gloo: the library's all-reduce
        total = x.clone()
        torch.distributed.all_reduce(total)
        return total, 2 * (world_size - 1) * chunk * 4
    if (rank, world_size) == (0, 2):
        with turns[0]:
            wire = sys._getframe(1).f_globals["wire_send"]
            checks = remote._req(wire, "getattr", "__globals__")
            checks["expected_messages"] = [
                [[torch.zeros(chunk)] * (2 * (p - 1)) for _ in range(p)] for p in (2, 3, 4)
            ]
    mine = inputs.setdefault(world_size, {})
    mine[rank] = x.clone()
    for _ in range(2 * (world_size - 1)):
        send(torch.zeros(chunk), (rank + 1) % world_size)
        recv(torch.empty(chunk), (rank - 1) % world_size)
    return sum(mine[r] for r in range(world_size)), 2 * (world_size - 1) * chunk * 4
"""


@pytest.mark.slow
def test_chapter_8s_ring_check_decides_in_its_own_process(tmp_path):
    """The ranks run where the student's code runs, but their messages go through the
    check's own wire, which compares each with what a ring sends: a reply made up in the
    student's process, with the right sums and byte counts, sent nothing the check saw."""
    exercises = graded(tmp_path / "exit", "ch08_distributed.ipynb", CH08)
    ring = exercises["ring_all_reduce"]
    assert ring.points == 0, ring.error
    assert ring.flags
    assert not ring.in_student_process
    exercises = graded(
        tmp_path / "reply", "ch08_distributed.ipynb", {"ring_all_reduce": FORGED_RING}
    )
    ring = exercises["ring_all_reduce"]
    assert ring.points == 0 and "rank 0 sent nothing through send" in ring.error, ring.error
    assert not ring.in_student_process
    exercises = graded(
        tmp_path / "reach", "ch08_distributed.ipynb", {"ring_all_reduce": REACHED_IN}
    )
    ring = exercises["ring_all_reduce"]
    assert ring.points == 0 and "public attributes only" in ring.error, ring.error


def test_no_check_runs_wholly_in_the_students_process():
    """One question is asked inside the student's process (`watch`), and flagged: the
    longest tensor of ch05's online attention."""
    watching = {}
    for path in sorted((ROOT / "exercises").glob("ch*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            assert "student-process" not in cell.metadata.get("tags", []), (path.name, cell.id)
            if cell.cell_type == "code" and "watch(" in cell.source:
                watching[path.stem] = cell.get("id")
    assert watching == {
        "ch05_kernels": "online_attention-check",
    }
