"""What a check uses to see the student's code at work, in a notebook and when graded.

In a notebook the student's code and the check share one namespace. When `minillm grade`
grades it, the student's code runs in a process of its own and the check in another, so
that nothing the student's code does can decide the check's verdict (see
`minillm.course.sandbox`). Two calls bridge them:

    from minillm.course.watching import lend, watch

    lend("model", model)  # the student's `model` is now the check's: each call is seen
    model.forward_causal = counting_forward
    ...
    longest = watch(WATCH_SOURCE, q=q, k=k, v=v)  # the check's code, in the student's process

`lend(name, value)` binds `name` among the student's names to the check's own object:
the student's functions that use that global (the setup's model or engine, the `time`
module) then call into the check's process, where the check's instruments record each
call. `watch(source, **values)` runs the check's own code `source` where the student's
code runs, for what only that process can see (the operations a torch function mode
records), and returns the name `result` it leaves; its answer could be forged, so the
grader flags the exercise as checked partly in the student's process.
`drive(source, **values)` runs a harness the same way, for a check that needs the
student's code to run in its own process (a coroutine on the student's event loop), and
is not flagged: the values it passes are the check's own functions, which the harness
calls (each call runs in the check's process, on its clock), and the check verifies
the harness's result against what those functions recorded.
"""

from __future__ import annotations

import sys
import time

LEND_HOOK = "_minillm_lend"  # set by the grader in the check's namespace
WATCH_HOOK = "_minillm_watch"
DRIVE_HOOK = "_minillm_drive"


def lend(name: str, value: object) -> None:
    """Make the student's global `name` the check's `value` (in a notebook: bind it)."""
    caller = sys._getframe(1).f_globals
    hook = caller.get(LEND_HOOK)
    if hook is not None:
        hook(name, value)
        return
    # where the notebook's functions look it up: the caller's globals, and those of the
    # functions it holds (the same dict in a notebook; a copy when a harness runs the check)
    for names in _notebook_namespaces(caller):
        names[name] = value
    if isinstance(value, Clock):  # the clocks the student's code imported by name, too
        for names in _notebook_namespaces(caller):
            for key, held in list(names.items()):
                if held is time:
                    names[key] = value
                else:
                    for clock in FORWARDED:
                        if held is getattr(time, clock):
                            names[key] = getattr(value, clock)


def _notebook_namespaces(caller: dict) -> list[dict]:
    """The caller's namespace, and that of each function in it that a notebook defined
    (one whose globals are not a module's): where a lent clock must be seen."""
    found = {id(caller): caller}
    for value in list(caller.values()):
        names = getattr(value, "__globals__", None)
        if type(names) is dict and names.get("__name__", "__main__") == "__main__":
            found.setdefault(id(names), names)
    return list(found.values())


def watch(source: str, **values: object) -> object:
    """Run `source` with the student's names and `values`; return the `result` it sets."""
    caller = sys._getframe(1).f_globals
    hook = caller.get(WATCH_HOOK)
    if hook is not None:
        return hook(source, **values)
    namespace = dict(caller)
    namespace.update(values)
    exec(compile(source, "<the check>", "exec"), namespace)
    return namespace.get("result")


def drive(source: str, **values: object) -> object:
    """Like `watch`, for a harness whose result the check verifies with its own records."""
    caller = sys._getframe(1).f_globals
    hook = caller.get(DRIVE_HOOK)
    if hook is not None:
        return hook(source, **values)
    namespace = dict(caller)
    namespace.update(values)
    exec(compile(source, "<the check>", "exec"), namespace)
    return namespace.get("result")


# the ways Python reads a wall clock; a lent `Clock` logs each of them
CLOCKS = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns")
# the clocks `time.clock_gettime(clk)` reads, under the name of the function that reads the
# same clock (on Linux `time.monotonic` is CLOCK_MONOTONIC and `time.time` CLOCK_REALTIME)
CLOCK_IDS = {"CLOCK_MONOTONIC": "monotonic", "CLOCK_REALTIME": "time"}
# clocks of the CPU time a process or thread has used: a step's CPU time is not the time it
# takes (a sleep, a wait for the GPU or for another process cost none), so a lent `Clock`
# answers them with an error that says the question is about wall time
CPU_CLOCKS = ("process_time", "process_time_ns", "thread_time", "thread_time_ns")
CPU_CLOCK_IDS = ("CLOCK_PROCESS_CPUTIME_ID", "CLOCK_THREAD_CPUTIME_ID")
# every function of the `time` module that a lent `Clock` answers in the student's stead
FORWARDED = (*CLOCKS, "clock_gettime", "clock_gettime_ns", *CPU_CLOCKS)


class WallTimeWanted(ValueError):
    """A timed exercise's answer read a CPU-time clock."""


def _cpu_clock(name: str) -> WallTimeWanted:
    return WallTimeWanted(
        f"{name} counts CPU time used, not the time that passed: this "
        "exercise asks for wall time (a sleep or a wait costs no CPU time but takes time); "
        "read time.perf_counter()"
    )


class Reading:
    """One reading of a clock, as the student's code got it. Two readings of the same clock
    subtract to the seconds between them, in that clock's own arithmetic (an `_ns` clock's
    nanoseconds are an int, as the student's code saw them)."""

    __slots__ = ("clock", "value")

    def __init__(self, clock: str, value: float | int) -> None:
        self.clock, self.value = clock, value

    def __sub__(self, earlier: Reading) -> float:
        if not isinstance(earlier, Reading):
            return NotImplemented
        if self.clock.removesuffix("_ns") != earlier.clock.removesuffix("_ns"):
            raise ValueError(f"time.{earlier.clock}() and time.{self.clock}() are different clocks")
        if self.clock == earlier.clock and self.clock.endswith("_ns"):
            return (self.value - earlier.value) / 1e9
        return self.seconds - earlier.seconds

    @property
    def seconds(self) -> float:
        return self.value / 1e9 if self.clock.endswith("_ns") else self.value

    def __repr__(self) -> str:
        return f"Reading({self.clock!r}, {self.value!r})"


class Clock:
    """The check's stand-in for the `time` module, to lend as the student's `time`: each
    reading of a clock in `CLOCKS`, or of CLOCK_MONOTONIC or CLOCK_REALTIME through
    `clock_gettime` (logged as `monotonic` or `time`), is appended to `log` as ("clock",
    Reading). A CPU-time clock (`process_time`, `thread_time`, their `_ns` forms and their
    `clock_gettime` ids) raises `WallTimeWanted`. When a check is graded, the student's
    process forwards its own `time` module's clocks (`FORWARDED`) to the lent one, so
    `from time import perf_counter`, `import time as t` and `timeit.default_timer` are seen
    too. Everything else (`sleep`, other clock ids, ...) is the `time` module's."""

    def __init__(self, log: list) -> None:
        self._log = log
        for name in CLOCKS:
            setattr(self, name, self._logged(name, getattr(time, name)))
        for name in CPU_CLOCKS:
            setattr(self, name, self._refused(f"time.{name}()"))

    @staticmethod
    def _refused(name: str):
        def reading(*args):
            raise _cpu_clock(name)

        reading.__name__ = name
        return reading

    def clock_gettime(self, clk_id: int) -> float:
        return self._by_id("clock_gettime", clk_id)

    def clock_gettime_ns(self, clk_id: int) -> int:
        return self._by_id("clock_gettime_ns", clk_id)

    def _by_id(self, function: str, clk_id: int) -> float | int:
        read = getattr(time, function)
        for id_name in CPU_CLOCK_IDS:
            if getattr(time, id_name, None) == clk_id:
                raise _cpu_clock(f"time.{function}(time.{id_name})")
        for id_name, clock in CLOCK_IDS.items():
            if getattr(time, id_name, None) == clk_id:
                value = read(clk_id)
                name = clock + "_ns" if function.endswith("_ns") else clock
                self._log.append(("clock", Reading(name, value)))
                return value
        return read(clk_id)

    def _logged(self, name: str, read):
        def reading():
            value = read()
            self._log.append(("clock", Reading(name, value)))
            return value

        reading.__name__ = name
        return reading

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)
