"""Where grading runs the checks: a process that only runs the reference's code, and for
each submission and exercise two children, one that runs the check and one that runs the
student's code.

`python -I -m minillm.course.sandbox` reads a job (JSON, on stdin) and writes one event per
line on stdout. The process runs the reference's setup cells (and the starters of its
answer cells) in order, in a namespace of its own, as a notebook would. It never runs a
line a student wrote, and never reads one: each submission's cells are in a file that
only that submission's processes open. At each check cell it forks, for each
submission, a *check process* that

1. forks the *student's process*, which closes every inherited descriptor but its socket
   to the check process, reads its own submission's cells, keeps a minimal environment,
   sets resource limits (memory, CPU time, file size, processes), forbids network
   sockets with seccomp unless the check cell carries the tag `network` (its processes
   talk over TCP), and, where Linux's Landlock is available, confines itself so that it
   can write only a fresh folder holding a copy of the files beside the submission, read
   only the Python installation, the installed packages and system folders, and signal
   no other process; then runs the student's cells up to this exercise, statement by
   statement, in a copy of the setup's namespace;
2. runs the reference's check in its own copy of the namespace, where each name the
   student defined (other than the setup's names and Python's builtins) is a
   `remote.Remote` of the student's object, or its value when it is plain data: the
   student's functions run in the student's process, and only plain data comes back
   (see `minillm.course.remote`);
3. asks the student's process what its code changed of the modules the checks rely on
   (a snapshot taken before the student's code ran: minillm, kernels, hypothesis, the
   standard library, torch, sys's hooks, the setup's values); a change fails the
   exercise as tampering;
4. writes the verdict to the grading process: only this process holds that pipe, and
   it is not dumpable, so that no process of the same user reads or writes its memory.

A check that watches the student's code at work lends it its own objects
(`minillm.course.watching.lend`: the student's global then names the check's object, and
each call runs here, where the check records it; a check that lends `time` has the
student's process forward its `time` module's clocks to the lent one, before the
student's code runs, so that a clock imported by name is the check's too), runs a
harness of its own where the student's code runs and verifies the result against its
own records (`drive`), or asks one question only that process can answer (`watch`: the
exercise's result then says it was checked partly in the student's process). A check
that replaces an attribute of an object it did not create and did not lend, defines a
torch function mode, or carries the tag `student-process` runs in the student's process
instead, and its result says so: there, a pass can be forged.

A crash or a hang loses only that exercise: the time limit kills the check process's
whole process group, the student's process with it. The result of each child is reported
as soon as it is decided.

This module imports only the standard library: it is loaded in every grading process.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import ctypes
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import secrets
import selectors
import shutil
import signal
import sys
import tempfile
import time
import traceback
import types

from minillm.course import remote
from minillm.course.watching import FORWARDED

# ---------------------------------------------------------------------------------------
# The student's definitions

CELL_MAGICS_WITH_PYTHON_BODY = ("time", "timeit", "capture", "prun")


def statements(code: str, filename: str) -> list[tuple[int, types.CodeType]]:
    """(line, code) of each top-level statement of a cell, compiled on its own, so that
    one that raises costs only itself, as far as the rest of the cell does not need it.

    A cell that IPython turned into one cell-magic call (`%%time` and the like, whose body
    is Python) is graded by its body. Raises SyntaxError.
    """
    tree = ast.parse(code, filename)
    body = _magic_body(tree)
    if body is not None:
        offset = code.count("\n", 0, code.index("run_cell_magic")) + 1
        tree = ast.parse("\n" * offset + body, filename)
    return [
        (node.lineno, compile(ast.Module(body=[node], type_ignores=[]), filename, "exec"))
        for node in tree.body
    ]


def _magic_body(tree: ast.Module) -> str | None:
    """The body of `get_ipython().run_cell_magic('time', '', body)`, if the cell is that."""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "run_cell_magic"
        and len(call.args) == 3
        and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in call.args)
    ):
        return None
    return call.args[2].value if call.args[0].value in CELL_MAGICS_WITH_PYTHON_BODY else None


# ---------------------------------------------------------------------------------------
# Failures a student can act on

_MAX_REPR = 300


def short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a student's object with a broken __repr__
        text = f"<{type(value).__name__} whose repr raised {type(exc).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}


def explain_compare(left_src: str, op: str, right_src: str, left: object, right: object) -> str:
    """The message of a failed `assert left op right` that has none: what each side was."""
    return f"{left_src} {op} {right_src} is false: {left_src} = {short_repr(left)}" + (
        "" if right_src == short_repr(right) else f", {right_src} = {short_repr(right)}"
    )


def explain_value(src: str, value: object) -> str:
    return f"{src} is false" + ("" if src == short_repr(value) else f": it is {short_repr(value)}")


class _ExplainAsserts(ast.NodeTransformer):
    """`assert a == b` (no message) -> evaluate a and b once, raise with both values."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.count = 0

    def visit_Assert(self, node: ast.Assert) -> ast.AST | list[ast.stmt]:
        if node.msg is not None:
            return node
        self.count += 1
        n = self.count
        test = node.test
        src = ast.get_source_segment(self.code, test) or ast.unparse(test)
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _OPS:
            left_name, right_name = f"_minillm_left_{n}", f"_minillm_right_{n}"
            left_src = ast.get_source_segment(self.code, test.left) or ast.unparse(test.left)
            right_src = ast.get_source_segment(self.code, test.comparators[0]) or ast.unparse(
                test.comparators[0]
            )
            op = _OPS[type(test.ops[0])]
            template = (
                f"{left_name} = 0\n{right_name} = 0\n"
                f"if not ({left_name} {op} {right_name}):\n"
                f"    raise AssertionError(_minillm_explain_compare("
                f"{left_src!r}, {op!r}, {right_src!r}, {left_name}, {right_name}))\n"
            )
            body = _located(ast.parse(template).body, node)
            body[0].value = test.left
            body[1].value = test.comparators[0]
        else:
            value_name = f"_minillm_value_{n}"
            template = (
                f"{value_name} = 0\n"
                f"if not {value_name}:\n"
                f"    raise AssertionError(_minillm_explain_value({src!r}, {value_name}))\n"
            )
            body = _located(ast.parse(template).body, node)
            body[0].value = test
        return body


def _located(body: list[ast.stmt], node: ast.AST) -> list[ast.stmt]:
    """Give every node of a code template the location of `node` (the assert it replaces)."""
    for stmt in body:
        for sub in ast.walk(stmt):
            if "lineno" in sub._attributes:
                ast.copy_location(sub, node)
    return body


def compile_check(code: str, filename: str) -> types.CodeType:
    """A check cell compiled so that a bare failed assert says what its sides were."""
    tree = ast.parse(code, filename)
    tree = _ExplainAsserts(code).visit(tree)
    ast.fix_missing_locations(tree)
    return compile(tree, filename, "exec")


CHECK_HELPERS = {
    "_minillm_explain_compare": explain_compare,
    "_minillm_explain_value": explain_value,
}


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


def _hypothesis_example(exc: BaseException) -> str | None:
    """Hypothesis's falsifying example ('check(n=1, bits=4)'), on one line."""
    for note in getattr(exc, "__notes__", []) or []:
        if note.startswith(("Falsifying example", "Failing test case")):
            body = note.split(":", 1)[1]
            lines = (line.split("#", 1)[0] if "#" in line else line for line in body.splitlines())
            text = " ".join(" ".join(lines).split())
            return text.replace("( ", "(").replace(", )", ")").replace(" )", ")")
    return None


def describe_failure(exc: BaseException, sources: dict[str, str]) -> dict:
    """What failed, in terms a student can act on.

    `sources` maps the filenames of the check and of the student's cells to their code.
    Returns {"error": one line, "message": the whole message, "input": hypothesis's
    falsifying example or None, "checked": the check's line that failed or None,
    "where": the student's line that raised or None}.
    """
    more = 0
    group = getattr(exc, "exceptions", None)  # an ExceptionGroup (a backport's on 3.10)
    if isinstance(group, tuple) and group and isinstance(group[0], BaseException):
        more = len(group) - 1
        example = _hypothesis_example(exc)
        exc = exc.exceptions[0]
        example = _hypothesis_example(exc) or example
    else:
        example = _hypothesis_example(exc)
    name = type(exc).__name__
    message = str(exc)
    error = f"{name}: {_first_line(message)}" if _first_line(message) else name
    if more:
        error += f" (and {more} other distinct failure{'s' if more > 1 else ''})"
    checked = None
    where = getattr(exc, "_minillm_where", None)
    where = where if type(where) is str else None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if filename not in sources:
            continue
        lines = sources[filename].split("\n")
        line = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
        if filename.startswith("<check"):
            checked = line
        else:
            where = f"{filename[1:-1]}, line {lineno}: {line}"
    return {
        "error": error,
        "message": message,
        "input": example,
        "checked": checked,
        "where": where,
    }


# ---------------------------------------------------------------------------------------
# What the student's code may not change

OWN_PACKAGES = ("minillm", "kernels", "builtins", "__main__")  # every attribute counts
DEEP_PACKAGES = ("minillm", "kernels", "hypothesis", "torch", "numpy", "__main__")
# libraries that rebind their own functions as they run: Triton's interpreter replaces the
# builtins of triton.language (program_id, arange, ...) with its own while it runs a kernel,
# and leaves some replaced after a kernel defined in an exercise cell has run
REBINDING_PACKAGES = ("triton",)
SKIPPED_ATTRIBUTES = re.compile(r"^(__warningregistry__|__loader__|__spec__|_abc_.*|__cached__)$")


def _own(module_name: str) -> bool:
    return module_name.split(".")[0] in OWN_PACKAGES


def _public(module_name: str) -> bool:
    return not any(part.startswith("_") for part in module_name.split("."))


def _deep(module_name: str) -> bool:
    """Modules whose functions' code and classes' members are compared too."""
    if _own(module_name):
        return True
    top = module_name.split(".")[0]
    return _public(module_name) and (top in DEEP_PACKAGES or top in sys.stdlib_module_names)


def _behaves(value: object) -> bool:
    """Code, as opposed to data: what another library may not have rebound under it."""
    return callable(value) or isinstance(value, types.ModuleType)


def _function_state(fn: types.FunctionType) -> tuple:
    cells = tuple(id(c.cell_contents) if _cell_full(c) else None for c in (fn.__closure__ or ()))
    return (id(fn.__code__), id(fn.__defaults__), id(fn.__kwdefaults__), cells)


def _cell_full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _container_state(value: object) -> tuple | None:
    """The identities of a container's items (a dict's keys too), or None for a non-container."""
    if isinstance(value, dict):
        return tuple(
            (k if isinstance(k, str | int | float) else id(k), id(v))
            for k, v in list(value.items())
        )
    if isinstance(value, set | frozenset):
        return tuple(sorted(id(v) for v in value))
    if isinstance(value, list | tuple):
        return tuple(id(v) for v in value)
    return None


def _class_state(cls: type) -> tuple:
    return tuple(
        sorted(
            (member, _function_state(v) if isinstance(v, types.FunctionType) else id(v))
            for member, v in list(vars(cls).items())
            if not SKIPPED_ATTRIBUTES.match(member)
        )
    )


def _watched(name: str, attr: str, value: object) -> bool:
    """Whether rebinding `attr` of module `name` counts as tampering."""
    if SKIPPED_ATTRIBUTES.match(attr) or name == "sys":  # sys's hooks are compared apart
        return False
    if name.split(".")[0] in REBINDING_PACKAGES:
        return False
    if _own(name):
        return True
    return _public(name) and not attr.startswith("_") and _behaves(value)


class Snapshot:
    """What the student's code must not change: the modules the checks use, sys's hooks, and
    the containers of the notebook's setup namespace.

    minillm's and kernels' modules count in full: every attribute, every function's code,
    defaults and closure, every class's members, every table's items. Other libraries'
    public modules count for the functions, classes and modules they expose (their data,
    such as caches, changes as they run); the public modules of torch, numpy, hypothesis
    and the standard library also count for their functions' code and classes' members.
    """

    def __init__(self, namespace: dict) -> None:
        self.namespace = namespace
        self.modules: dict[str, tuple[int, dict[str, int]]] = {}
        self.deep: dict[tuple[str, str], tuple] = {}
        for name, module in list(sys.modules.items()):
            attrs = getattr(module, "__dict__", None)
            if not isinstance(attrs, dict):
                continue
            self.modules[name] = (
                id(module),
                {k: id(v) for k, v in list(attrs.items()) if _watched(name, k, v)},
            )
            if _deep(name):
                for attr, value in list(attrs.items()):
                    state = self._deep_state(name, attr, value)
                    if state is not None:
                        self.deep[name, attr] = state
        self.values = {
            key: state
            for key, value in namespace.items()
            if (state := _container_state(value)) is not None
        }
        self.hooks = self._hooks()

    @staticmethod
    def _deep_state(name: str, attr: str, value: object) -> tuple | None:
        if isinstance(value, types.FunctionType) and value.__module__ == name:
            return _function_state(value)
        if isinstance(value, type) and value.__module__ == name:
            return _class_state(value)
        if _own(name) and not attr.startswith("__"):
            return _container_state(value)
        return None

    @staticmethod
    def _hooks() -> tuple:
        import threading

        return (
            id(sys.gettrace()),
            id(sys.getprofile()),
            id(threading.gettrace()) if hasattr(threading, "gettrace") else 0,
            tuple(id(f) for f in sys.meta_path),
            tuple(id(h) for h in sys.path_hooks),
            id(sys.modules),
            id(builtins.__import__),
        )

    def changes(self, limit: int = 5) -> list[str]:
        """What differs from the snapshot: up to `limit` names."""
        found: list[str] = []
        if self._hooks() != self.hooks:
            found.append("the interpreter's hooks (sys.settrace, sys.meta_path or __import__)")
        for name, (module_id, attrs) in self.modules.items():
            module = sys.modules.get(name)
            if module is None or id(module) != module_id:
                if _own(name) or (_deep(name) and name in sys.modules):
                    found.append(f"the module {name} (replaced or removed from sys.modules)")
                continue
            now = getattr(module, "__dict__", {})
            found.extend(
                f"{name}.{attr}"
                for attr, value_id in attrs.items()
                if attr not in now or id(now[attr]) != value_id
            )
        for (name, attr), state in self.deep.items():
            module = sys.modules.get(name)
            value = getattr(module, "__dict__", {}).get(attr) if module else None
            key = f"{name}.{attr}"
            if self._deep_state(name, attr, value) != state and key not in found:
                found.append(key)
        for key, state in self.values.items():
            if _container_state(self.namespace.get(key)) != state:
                found.append(f"{key} (a value of the notebook's setup)")
        return found[:limit]


# ---------------------------------------------------------------------------------------
# Landlock: what a child may read and write

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 38, 1, 36
PR_SET_DUMPABLE = 4
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
SYSTEM_READ_ROOTS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The Landlock ABI version of this kernel; 0 where there is none (or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        abi = _libc().syscall(
            ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1)
        )
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


def read_roots(protected: list[str]) -> list[str]:
    """Folders a child may read: Python, its packages, system folders.

    A folder that holds any of the `protected` paths (the reference, the submissions) is
    left out; a package installed in editable mode is allowed its own folder only.
    """
    candidates = set(SYSTEM_READ_ROOTS)
    candidates.update((sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix))
    candidates.update(p for p in sys.path if p and os.path.isdir(p))
    for package in ("minillm", "kernels"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            candidates.update(spec.submodule_search_locations)
    protected_real = [os.path.realpath(p) for p in protected]
    roots = []
    for root in sorted(candidates):
        real = os.path.realpath(root)
        if not os.path.exists(real):
            continue
        if any(p == real or p.startswith(real.rstrip("/") + "/") for p in protected_real):
            continue
        roots.append(real)
    return roots


def confine(abi: int, writable: str, readable: list[str], network: bool = False) -> None:
    """Restrict this process and its children with Landlock (irreversibly).

    With `network`, TCP bind and connect stay allowed (Landlock cannot limit them to the
    loopback address, only to ports), for checks whose processes talk over torch.distributed.
    Raises OSError when the kernel refuses.
    """
    libc = _libc()
    handled_fs = (1 << 13) - 1
    if abi >= 2:
        handled_fs |= 1 << 13  # REFER
    if abi >= 3:
        handled_fs |= FS_TRUNCATE
    if abi >= 5:
        handled_fs |= FS_IOCTL_DEV
    attr = _RulesetAttr(handled_fs, 0, 0)
    size = 8
    if abi >= 4 and not network:
        attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP
        size = 16
    if abi >= 6:
        attr.scoped = SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET
        size = 24
    ruleset = libc.syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET),
        ctypes.byref(attr),
        ctypes.c_size_t(size),
        ctypes.c_uint32(0),
    )
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    file_rights = (FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV) & (
        handled_fs
    )

    def allow(path: str, access: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if not os.path.isdir(path):
                access &= file_rights
            rule = _PathBeneathAttr(access & handled_fs, fd)
            if libc.syscall(
                ctypes.c_long(SYS_LANDLOCK_ADD_RULE),
                ctypes.c_int(ruleset),
                ctypes.c_int(1),
                ctypes.byref(rule),
                ctypes.c_uint32(0),
            ):
                raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
        finally:
            os.close(fd)

    try:
        for root in readable:
            allow(root, FS_EXECUTE | FS_READ_FILE | FS_READ_DIR)
        allow("/dev", FS_READ_DIR)
        for device in DEVICES:
            allow(device, FS_READ_FILE | FS_WRITE_FILE)
        allow(writable, handled_fs)
        if network:
            # multiprocessing's queues and locks are POSIX semaphores, files in /dev/shm
            allow("/dev/shm", handled_fs)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(
            ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)
        ):
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)


# ---------------------------------------------------------------------------------------
# Resource limits and the network, for the student's process

DEFAULT_MEMORY_GIB = 4.0  # more than the process held at the fork, for the student's code
MAX_FILE_BYTES = 64 * 2**20
SPARE_PROCESSES = 256  # threads and processes the student's code may add to the machine's
KEPT_ENVIRONMENT = (
    "PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LANG",
    "LC_ALL",
    "CUDA_VISIBLE_DEVICES",
    "TOKENIZERS_PARALLELISM",
    "MPLBACKEND",
    "TRITON_INTERPRET",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def limit_resources(cpu_s: float, memory_gib: float) -> list[str]:
    """Set this process's rlimits; returns the names of those the platform refused.

    Memory is RLIMIT_DATA (private writable memory, what allocations grow) above what the
    process held at the fork; processes are RLIMIT_NPROC above the machine's current count
    of threads (the limit counts all of this user's, and cannot say "children only").
    """
    import resource

    refused = []
    wanted = [
        ("RLIMIT_CORE", 0),
        ("RLIMIT_FSIZE", MAX_FILE_BYTES),
        ("RLIMIT_CPU", int(cpu_s) + 5),
    ]
    if sys.platform.startswith("linux"):
        wanted.append(("RLIMIT_DATA", _status_kib("VmData") * 1024 + int(memory_gib * 2**30)))
        with open("/proc/loadavg") as f:
            threads = int(f.read().split()[3].split("/")[1])
        wanted.append(("RLIMIT_NPROC", threads + SPARE_PROCESSES))
    for name, value in wanted:
        which = getattr(resource, name, None)
        try:
            _, hard = resource.getrlimit(which)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(which, (value, value if name != "RLIMIT_CPU" else value + 2))
        except (ValueError, OSError, TypeError):
            refused.append(name)
    return refused


PIDS_HIERARCHY = "/sys/fs/cgroup/pids"  # where cgroup v1 mounts its `pids` controller


def pids_cgroup() -> str | None:
    """The folder of this process's group in the cgroup v1 `pids` hierarchy, if this
    process may make groups under it (root, where the hierarchy is mounted writable): a
    group per student process, whose `pids.max` limits the processes and threads of all
    its members, root's included. None where it may not."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "pids" in controllers.split(","):
            folder = os.path.join(PIDS_HIERARCHY, path.lstrip("/"))
            probe = make_pids_group(folder, f"minillm-probe-{os.getpid()}", 1)
            if probe is None:
                return None
            remove_pids_group(probe)
            return folder
    return None


def make_pids_group(parent: str, name: str, limit: int) -> str | None:
    """A new group under `parent` whose members may hold `limit` processes and threads in
    all; None if it cannot be made."""
    path = os.path.join(parent, name)
    try:
        os.mkdir(path, 0o700)
    except OSError:
        return None
    try:
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(limit))
    except OSError:
        remove_pids_group(path)
        return None
    return path


def join_pids_group(path: str) -> None:
    """Move this process into the group (its children are born there)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def remove_pids_group(path: str, reap=None) -> None:
    """Kill what is left in the group and remove it; `reap` waits for the killed children."""
    for _ in range(200):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if reap is not None:
            reap()
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.005)


def process_limit_warning() -> str | None:
    """What the grader says when a submission's processes cannot be limited: the kernel
    does not hold root to RLIMIT_NPROC, and no `pids` cgroup can take its place. (Running
    the student's process as an unprivileged user would need that user to read the Python
    installation, which a root-only install under /root does not allow.)"""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or pids_cgroup() is not None:
        return None
    return (
        "grading runs as root, whom the kernel does not hold to RLIMIT_NPROC, so the number "
        "of processes a submission starts is not limited; grade as another user"
    )


def limits_not_applied(confine: bool = True) -> list[str]:
    """Each limit on a submission's process that this machine does not apply, and why: the
    grader puts them in every report, since a grade is only as safe as they are. Tried in a
    throwaway child, as `_student` applies them."""
    missing = []
    if process_limit_warning() is not None:
        missing.append(
            "RLIMIT_NPROC: the grader runs as root, whom the kernel does not hold to it, and "
            "no cgroup v1 `pids` hierarchy is writable here, so the number of processes a "
            "submission starts is limited only by the time limit, which kills them all"
        )
    if not hasattr(os, "fork"):
        return missing + ["resource limits, seccomp and Landlock: this system has no fork"]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            refused = limit_resources(60.0, DEFAULT_MEMORY_GIB)
            network = sys.platform.startswith("linux") and deny_network()
            os.write(write_end, json.dumps({"refused": refused, "seccomp": network}).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    try:
        probe = json.loads(data)
    except ValueError:
        probe = {"refused": ["every resource limit"], "seccomp": False}
    missing.extend(f"{name}: the system refused it" for name in probe["refused"])
    if not probe["seccomp"]:
        missing.append(
            "seccomp: not available here, so a submission's code can open network sockets"
        )
    if not confine:
        missing.append(
            "Landlock: not asked for, so a submission's code can read and write "
            "any file the grader can"
        )
    elif not landlock_abi():
        missing.append(
            "Landlock: not in this system's kernel, so a submission's code can read and write "
            "any file the grader can; grade untrusted work in a container"
        )
    return missing


# seccomp: socket() for anything but AF_UNIX, and io_uring (which makes sockets without it),
# fail with EACCES; so does every system call of another architecture's ABI
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def deny_network() -> bool:
    """Forbid this process and its children to open a network socket; False where it cannot."""
    spec = SECCOMP_ARCH.get(os.uname().machine)
    if spec is None:
        return False
    arch, socket_nr, io_uring_setup = spec
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    errno_eacces, allow = 0x00050000 | 13, 0x7FFF0000
    program = [
        (ld, 0, 0, 4),  # arch
        (jeq, 0, 6, arch),
        (ld, 0, 0, 0),  # system call number
        (jge, 4, 0, 0x40000000),  # x32 ABI
        (jeq, 3, 0, io_uring_setup),
        (jeq, 0, 3, socket_nr),
        (ld, 0, 0, 16),  # socket's domain
        (jeq, 1, 0, 1),  # AF_UNIX
        (ret, 0, 0, errno_eacces),
        (ret, 0, 0, allow),
    ]
    filters = (_SockFilter * len(program))(*[_SockFilter(*f) for f in program])
    prog = _SockFprog(len(program), filters)
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0


# ---------------------------------------------------------------------------------------
# The grading process and its children


class SetupTimeout(Exception):
    """A setup cell of the reference ran past its time limit."""


def _on_alarm(signum, frame):
    raise SetupTimeout


@dataclasses.dataclass(slots=True)
class Child:
    pid: int
    submission: int
    exercise: int
    fd: int
    output_fd: int  # the file the child's stdout and stderr go to, opened here
    workdir: str
    nonce: str
    deadline: float
    started: float
    data: bytearray = dataclasses.field(default_factory=bytearray)
    pids_group: str | None = None  # the student's process's cgroup, removed at the end


MAX_RESULT_BYTES = 1 << 20
OUTPUT_TAIL_CHARS = 2000


class Grader:
    """Runs the reference's steps and the children of each check (the sandbox process)."""

    def __init__(self, job: dict, events) -> None:
        self.job = job
        self.events = events
        self.jobs = max(1, int(job["jobs"]))
        self.timeout_s = float(job["timeout_s"])
        self.workdir = job["workdir"]
        self.abi = landlock_abi() if job.get("confine", True) else 0
        self.readable = read_roots(job.get("protected", [])) if self.abi else []
        self.namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        self.functions = {f for ex in job["exercises"] for f in ex["functions"]}
        self.running: dict[int, Child] = {}
        self.selector = selectors.DefaultSelector()
        self.count = 0
        # as root, whom RLIMIT_NPROC does not hold, a `pids` cgroup per student process
        root = hasattr(os, "geteuid") and os.geteuid() == 0
        self.pids_parent = pids_cgroup() if root else None
        self.pids_group: str | None = None  # the group of the child being forked

    def send(self, event: dict) -> None:
        self.events.write(json.dumps(event) + "\n")
        self.events.flush()

    # the reference's own code

    def run_setup(self, step: dict) -> None:
        limit = max(self.timeout_s, float(self.job.get("setup_timeout_s", 0)))
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            exec(compile(step["source"], f"<cell {step['index']}>", "exec"), self.namespace)
        except SetupTimeout:
            self.send({"event": "setup", "cell": step["index"], "error": f"ran past {limit:g} s"})
        except BaseException as exc:  # the reference's own error: reported, and grading goes on
            self.send({"event": "setup", "cell": step["index"], "error": _one_line(exc)})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def run_check(self, step: dict) -> None:
        k = step["exercise"]
        exercise = self.job["exercises"][k]
        filename = f"<check of exercise {exercise['number']}>"
        try:
            code = compile_check(step["source"], filename)
        except SyntaxError as exc:
            self.send({"event": "setup", "cell": step["index"], "error": _one_line(exc)})
            return
        _preimport(step["source"])
        for i, submission in enumerate(self.job["submissions"]):
            if k in submission.get("skip", []):
                continue
            self.wait_for_slot(exclusive=exercise.get("timing", False))
            self.fork(i, k, submission, code, filename, step["source"])
            if exercise.get("timing", False):
                self.wait_for_slot(exclusive=True)

    # children

    def wait_for_slot(self, exclusive: bool) -> None:
        limit = 0 if exclusive else self.jobs - 1
        while len(self.running) > limit:
            self.poll()

    def poll(self) -> None:
        now = time.monotonic()
        timeout = min((c.deadline for c in self.running.values()), default=now + 1) - now
        for key, _ in self.selector.select(timeout=max(0.0, min(timeout, 1.0))):
            child = key.data
            try:
                chunk = os.read(child.fd, 65536)
            except BlockingIOError:
                continue
            if chunk and len(child.data) < MAX_RESULT_BYTES:
                child.data.extend(chunk)
            if not chunk:
                self.finish(child, timed_out=False)
        now = time.monotonic()
        for child in [c for c in self.running.values() if c.deadline <= now]:
            self.finish(child, timed_out=True)

    def fork(self, i, k, submission, code, filename, check_source) -> None:
        self.count += 1
        workdir = os.path.join(self.workdir, f"s{i}-e{k}-{self.count}")
        os.mkdir(workdir)
        read_fd, write_fd = os.pipe()
        # opened here, read back through this descriptor: whatever the child does to the
        # file's name (a link to the reference, say) cannot make this process read another
        output_fd = os.open(
            os.path.join(workdir, "output.txt"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600
        )
        nonce = secrets.token_hex(16)
        self.pids_group = None
        if self.pids_parent is not None:
            name = f"minillm-{os.getpid()}-{self.count}"
            self.pids_group = make_pids_group(self.pids_parent, name, SPARE_PROCESSES)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns to this loop
            try:
                os.close(read_fd)
                _child(
                    self,
                    k,
                    submission,
                    code,
                    filename,
                    check_source,
                    workdir,
                    write_fd,
                    output_fd,
                    nonce,
                )
            finally:
                os._exit(1)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        now = time.monotonic()
        child = Child(pid, i, k, read_fd, output_fd, workdir, nonce, now + self.timeout_s, now)
        child.pids_group = self.pids_group
        self.running[pid] = child
        self.selector.register(read_fd, selectors.EVENT_READ, child)
        self.send({"event": "start", "submission": i, "exercise": k})

    def finish(self, child: Child, timed_out: bool) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child.pid, signal.SIGKILL)
        _, status = os.waitpid(child.pid, 0)
        self.selector.unregister(child.fd)
        os.close(child.fd)
        del self.running[child.pid]
        _kill_strays(set(self.running))
        if child.pids_group is not None:
            remove_pids_group(child.pids_group, lambda: _kill_strays(set(self.running)))
        seconds = round(time.monotonic() - child.started, 3)
        number = self.job["exercises"][child.exercise]["number"]
        result = None
        if timed_out:
            result = {
                "passed": False,
                "error": f"Timeout: the check of exercise {number} ran longer than "
                f"{self.timeout_s:g} s and was stopped",
            }
        else:
            result = _parse_result(bytes(child.data), child.nonce)
        if result is None:
            if os.WIFSIGNALED(status):
                how = f"killed by signal {os.WTERMSIG(status)}"
            else:
                how = f"exit status {os.WEXITSTATUS(status)}"
            result = {
                "passed": False,
                "error": f"Crash: the process checking exercise {number} ended ({how}) before "
                "the check finished: an exit call, a crash in native code, or too much memory",
            }
        result["output"] = _tail(child.output_fd)
        os.close(child.output_fd)
        shutil.rmtree(child.workdir, ignore_errors=True)
        result.update(
            {
                "event": "result",
                "submission": child.submission,
                "exercise": child.exercise,
                "seconds": seconds,
            }
        )
        self.send(result)

    def run(self) -> None:
        self.send({"event": "ready", "landlock": self.abi})
        if sys.platform.startswith("linux"):
            _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        for name in self.job.get("preimport", []):
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        for step in self.job["steps"]:
            if step["kind"] == "setup":
                self.run_setup(step)
            else:
                self.run_check(step)
        while self.running:
            self.poll()
        self.send({"event": "done"})


def _one_line(exc: BaseException) -> str:
    first = _first_line(str(exc))
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _tail(fd: int) -> str:
    """The end of what a child printed."""
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - 4 * OUTPUT_TAIL_CHARS), os.SEEK_SET)
        data = os.read(fd, 4 * OUTPUT_TAIL_CHARS)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")[-OUTPUT_TAIL_CHARS:]


def _parse_result(data: bytes, nonce: str) -> dict | None:
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict) and result.pop("nonce", None) == nonce:
            return {
                "passed": result.get("passed") is True,
                **{
                    k: result.get(k)
                    for k in (
                        "error",
                        "message",
                        "input",
                        "checked",
                        "where",
                        "notes",
                        "student_process",
                    )
                },
            }
    return None


def _kill_strays(running: set[int]) -> None:
    """Kill the processes a child left behind (they were handed to this one as orphans)."""
    try:
        tasks = os.listdir(f"/proc/{os.getpid()}/task")
    except OSError:
        return
    for task in tasks:
        try:
            with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            if pid not in running:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def _preimport(check_source: str) -> None:
    """Import what a check imports, before the snapshot, so that it is protected too."""
    try:
        tree = ast.parse(check_source)
    except SyntaxError:
        return
    if "torch" in sys.modules:
        # torch._dynamo rebinds torch functions (torch.manual_seed) when it is first imported
        with contextlib.suppress(Exception):
            importlib.import_module("torch._dynamo")
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _child(
    grader: Grader,
    k: int,
    submission: dict,
    code: types.CodeType,
    filename: str,
    check_source: str,
    workdir: str,
    result_fd: int,
    output: int,
    nonce: str,
) -> None:
    """Run exercise k's check on one submission; writes one JSON line, then exits.

    This process runs only the reference's code. The student's code runs in a process of
    its own, forked from this one before the student's cells are read, and is reached
    only through `remote.Connection`: the check's verdict, its values and the pipe to the
    grader stay here.
    """
    status = 0
    student_pid = 0
    try:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        os.setpgid(0, 0)
        if sys.platform.startswith("linux"):
            _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # no process of the same user may read or write this one's memory or descriptors
            _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(devnull)
        os.close(output)
        for fd in (
            *(c.output_fd for c in grader.running.values()),
            grader.events.fileno(),
            grader.selector.fileno(),
            *(c.fd for c in grader.running.values()),
        ):
            with contextlib.suppress(OSError):
                os.close(fd)
        if "torch" in sys.modules:  # the grading process used OpenMP threads before the fork
            sys.modules["torch"].set_num_threads(1)
        ours, theirs = remote.pair()
        sys.stdout.flush()
        sys.stderr.flush()
        student_pid = os.fork()
        if student_pid == 0:
            try:
                ours.close()
                _student(grader, k, submission, workdir, theirs, (code, filename, check_source))
            finally:
                os._exit(1)
        theirs.close()
        result = _check(grader, k, code, filename, check_source, ours, student_pid)
    except BaseException as exc:  # the child must report, whatever happened
        result = {"passed": False, "error": f"the grader failed: {_one_line(exc)}"}
        status = 1
    if student_pid:
        with contextlib.suppress(OSError):
            os.kill(student_pid, signal.SIGKILL)
    result["nonce"] = nonce
    try:
        os.write(result_fd, (json.dumps(result) + "\n").encode())
    finally:
        os._exit(status)


def _student(grader: Grader, k: int, submission: dict, workdir: str, sock, check) -> None:
    """The process of the student's code: confined, limited, answering the check's calls."""
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    prctl = _libc().prctl if sys.platform.startswith("linux") else None
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if grader.pids_group is not None:  # its processes and threads, and theirs, are counted
        with contextlib.suppress(OSError):
            join_pids_group(grader.pids_group)
    with open(submission["cells_path"], encoding="utf-8") as f:  # its own cells, no one else's
        cells = json.load(f)
    files = submission.get("files")
    if files and os.path.isdir(files):
        shutil.copytree(files, workdir, dirs_exist_ok=True)
    os.chdir(workdir)
    kept = {var: os.environ[var] for var in KEPT_ENVIRONMENT if var in os.environ}
    os.environ.clear()
    os.environ.update(kept)
    for var in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "MPLCONFIGDIR"):
        os.environ[var] = workdir
    tempfile.tempdir = workdir  # gettempdir() caches the folder the grader saw
    network = grader.job["exercises"][k].get("network", False)
    limit_resources(grader.timeout_s, float(grader.job.get("memory_gib", DEFAULT_MEMORY_GIB)))
    if prctl is not None and not network:
        deny_network()
    if grader.abi:
        confine(grader.abi, workdir, grader.readable, network=network)
    # a check that lends the clock sees it read whichever way the student's code reads it
    clock = _forward_clocks() if "time" in _lent(check[2]) else None
    # after the fork (which resets some of threading's state), before the student's code
    snapshot = Snapshot(grader.namespace)
    changes = snapshot.changes
    setup = grader.namespace
    student = dict(setup)
    conn = remote.Connection(sock, trusted=False)
    notes = []
    for cell in cells:
        if cell["exercise"] > k:
            continue
        conn.sources[cell["filename"]] = cell["source"]
        try:
            compiled = statements(cell["source"], cell["filename"])
        except SyntaxError:
            continue  # reported by the caller
        for line, statement in compiled:
            try:
                exec(statement, student)
            except Exception as exc:
                notes.append(f"{cell['filename'][1:-1]}, line {line}: {_one_line(exc)}")
    protected = set(setup) - grader.functions
    names = {}
    for name, value in student.items():
        if name.startswith("__") or (name in setup and setup[name] is value):
            continue
        if name in protected or hasattr(builtins, name):
            if not _same(value, setup.get(name, getattr(builtins, name, None))):
                notes.append(
                    f"your code defines {name}, which the notebook's "
                    + ("setup" if name in protected else "Python")
                    + " defines too: the check uses that one, your functions use yours"
                )
            continue
        names[name] = value
    conn.exported[0] = lambda: {"names": names, "notes": notes}
    conn.exported[1] = lambda: changes()
    conn.exported[2] = lambda: _check_here(setup, names, conn.sources, *check)
    conn.exported[3] = lambda name, value: _bind(student, clock, str(name), value)
    conn.exported[4] = lambda source, values: _watch_here(setup, names, source, values)
    conn.serve_forever()
    os._exit(0)


def _forward_clocks() -> list:
    """Make the `time` module's clocks (and `timeit.default_timer`) in this process read the
    clock the check lends as `time`, once it lends one, so that a clock the student's code
    imports by name (`from time import perf_counter`) or through another name
    (`import time as t`) is the check's too. Returns the holder of the lent clock."""
    import timeit

    lent: list = [None]

    def forwarding(name: str, own):
        def read(*args):
            clock = lent[0]
            return own(*args) if clock is None else getattr(clock, name)(*args)

        read.__name__ = read.__qualname__ = name
        return read

    for name in FORWARDED:
        setattr(time, name, forwarding(name, getattr(time, name)))
    timeit.default_timer = time.perf_counter
    return lent


def _bind(student: dict, clock: list | None, name: str, value: object) -> None:
    """The check lends `value` as the student's `name` (see `watching.lend`)."""
    student[name] = value
    if name == "time" and clock is not None:
        clock[0] = value


def _lent(check_source: str) -> set[str]:
    try:
        return lent_names(ast.parse(check_source))
    except SyntaxError:
        return set()


def _check_here(setup: dict, names: dict, sources: dict, code, filename, check_source) -> dict:
    """The check run in the student's process (a check that needs the student's live objects,
    or that watches the student's code from inside): what it reports can be forged."""
    check = dict(setup)
    check.update(names)  # without the setup's names and Python's builtins (see _student)
    check.update(CHECK_HELPERS)
    try:
        exec(code, check)
    except BaseException as exc:
        return {"passed": False, **describe_failure(exc, {filename: check_source, **sources})}
    return {"passed": True, "error": None}


def _watch_here(setup: dict, names: dict, source, values) -> object:
    """The part of a check that watches the student's code from inside (see `watch`), run
    in the student's process: its `result`, which the check receives as plain data."""
    namespace = dict(setup)
    namespace.update(names)
    namespace.update(values if type(values) is dict else {})
    exec(compile(str(source), "<the check, in your process>", "exec"), namespace)
    return namespace.get("result")


def _check_helpers(conn: remote.Connection, watched: list[bool]) -> dict:
    """How `minillm.course.watching`'s `lend` and `watch` work when a check is graded."""

    def lend(name: str, value: object) -> None:
        """Bind `name` in the student's namespace to the check's own `value`: the student's
        functions that use that global (a model, the setup's engine, the `time` module)
        then call into the check's process, where the check sees each call."""
        conn.request("call", 3, name, remote.ByReference(value))

    def watch(source: str, **values) -> object:
        """Run `source` (the check's own code) in the student's process, with the student's
        names and `values`, and return its `result` as plain data: for what can only be
        seen from inside (the operations a torch function mode records). The exercise is
        then flagged as checked partly in the student's process."""
        watched[0] = True
        return conn.request("call", 4, source, values)

    def drive(source: str, **values) -> object:
        """Run the check's harness `source` in the student's process, as `watch` does; the
        check verifies its `result` against what its own functions in `values` recorded
        (they run here, each call a request from the student's process)."""
        return conn.request("call", 4, source, values)

    return {
        **CHECK_HELPERS,
        "_minillm_lend": lend,
        "_minillm_watch": watch,
        "_minillm_drive": drive,
    }


def lent_names(tree: ast.AST) -> set[str]:
    """The names a check lends the student's code: `lend("model", model)`."""
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "lend"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }


def student_process_check(source: str) -> bool:
    """Whether a check watches the student's code from inside, which only works in the
    process that runs that code: a torch function mode that records the operations it
    runs, or an attribute the check sets on an object or module it did not create (a
    patched method of the setup's model, a replaced Triton launcher)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    created: set[str] = lent_names(tree)  # what the student's code uses of them is the check's
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            created.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            created.add(node.name)
        elif isinstance(node, ast.arg):
            created.add(node.arg)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            "FunctionMode" in ast.unparse(b) or "DispatchMode" in ast.unparse(b) for b in node.bases
        ):
            return True
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            root = target
            while isinstance(root, ast.Attribute | ast.Subscript):
                root = root.value
            if target is not root and isinstance(target, ast.Attribute):
                if isinstance(root, ast.Name) and root.id not in created:
                    return True
    return False


def _check(grader: Grader, k, code, filename, check_source, conn_sock, student_pid) -> dict:
    conn = remote.Connection(conn_sock, trusted=True)
    try:
        session = conn.request("call", 0)
    except remote.PeerGone:
        return _crashed(grader, k, student_pid, "before its definitions were done")
    names, notes = _plain_session(session)
    exercise = grader.job["exercises"][k]
    if exercise.get("student_process") or student_process_check(check_source):
        try:
            reported = conn.request("call", 2)
        except remote.PeerGone:
            return _crashed(grader, k, student_pid, "while the check ran")
        except BaseException as exc:
            reported = {"passed": False, "error": _one_line(exc)}
        result = _plain_result(reported)
        result["student_process"] = True
        result["notes"] = notes
        return result
    check = dict(grader.namespace)
    for name, value in names.items():
        if name.startswith("__") or hasattr(builtins, name):
            continue  # the check's builtins stay Python's
        if name in check and name not in grader.functions:
            continue  # names the setup defines keep the setup's values
        check[name] = value
    watched = [False]
    check.update(_check_helpers(conn, watched))
    sources = {filename: check_source}
    try:
        exec(code, check)
    except BaseException as exc:
        if conn.gone:
            return _crashed(grader, k, student_pid, "while the check ran")
        result = {"passed": False, **describe_failure(exc, sources)}
    else:
        result = {"passed": True, "error": None}
    try:
        changed = conn.request("call", 1)
    except BaseException:
        if conn.gone:
            return _crashed(grader, k, student_pid, "while the check ran")
        changed = []
    changed = [c for c in changed if type(c) is str] if type(changed) is list else []
    if changed:
        result = {
            "passed": False,
            "error": "Tampering: your code changed "
            + ", ".join(changed[:5])
            + ", which the checks rely on",
        }
    if watched[0]:
        result["student_process"] = True
    result["notes"] = notes
    return result


def _plain_result(reported) -> dict:
    """A result as the student's process reported it, as plain strings."""
    reported = reported if type(reported) is dict else {}
    result = {"passed": reported.get("passed") is True}
    for key in ("error", "message", "input", "checked", "where"):
        value = reported.get(key)
        result[key] = value if type(value) is str else None
    return result


def _plain_session(session) -> tuple[dict, list[str]]:
    if type(session) is not dict:
        return {}, []
    names = session.get("names")
    notes = session.get("notes")
    names = {k: v for k, v in names.items() if type(k) is str} if type(names) is dict else {}
    notes = [n for n in notes if type(n) is str] if type(notes) is list else []
    return names, notes


def _crashed(grader: Grader, k: int, pid: int, when: str) -> dict:
    number = grader.job["exercises"][k]["number"]
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        status = None
    if status is not None and os.WIFSIGNALED(status):
        how = f"killed by signal {os.WTERMSIG(status)}"
    elif status is not None:
        how = f"exit status {os.WEXITSTATUS(status)}"
    else:
        how = "it was gone"
    return {
        "passed": False,
        "error": f"Crash: the process checking exercise {number} ended ({how}) {when}: an exit "
        "call, a crash in native code, or too much memory in your code",
    }


def _names(source: str) -> set[str]:
    try:
        return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    except SyntaxError:
        return set()


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays and tensors compare element by element
        return False


def main() -> int:
    job = json.load(sys.stdin)
    events = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    log = os.open(os.path.join(job["workdir"], "setup-output.txt"), os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    Grader(job, events).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
