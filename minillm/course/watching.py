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
    caller[name] = value


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
