"""Profile one engine step with `torch.profiler`: the operators that took its CPU time.

On a GPU machine Nsight Systems shows the whole process on a timeline and Nsight Compute
one kernel's counters; `torch.profiler` is the tool every machine has. It records each
`aten` operator a step runs, with its calls and its *self* time (the time inside the
operator, less the operators it called), which is what the table of a profile ranks by.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True, slots=True)
class OpTime:
    """One operator of a profile: its name, calls, and self CPU time in µs."""

    name: str
    calls: int
    self_cpu_us: float


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: the profiler's C++ back end (Kineto) logs its start and
    stop there, below Python's sys.stderr, so a notebook cell would show the lines."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def profile_step(step: Callable[[], object]) -> tuple[list[OpTime], float]:
    """Run `step()` once under torch.profiler (CPU activity). Returns (every operator with
    a self time, largest first; the sum of their self times in µs, the step's CPU time)."""
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = [
        OpTime(e.key, e.count, e.self_cpu_time_total)
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    ]
    ops.sort(key=lambda op: op.self_cpu_us, reverse=True)
    return ops, sum(op.self_cpu_us for op in ops)
