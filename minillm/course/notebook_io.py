"""Reading notebooks, finding their graded cells, and running them in a Jupyter kernel.

`read_notebook` validates before it trusts a file (a submission can be anything), and
`execute_notebook` runs a notebook top to bottom the way Jupyter does: `minillm exercises
execute` stores the solutions' outputs with it, and the tests run exercise notebooks with
it. Grading does not use a kernel (see `minillm.course.sandbox`).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import tempfile

import nbformat
from nbformat.v4.rwbase import rejoin_lines, strip_transient
from nbformat.validator import iter_validate

GRADED_RE = re.compile(r"^\s*#\s*GRADED:\s*(\d+)\s+points?\s*$", re.MULTILINE)
KERNEL_NAME = "python3"


class NotebookReadError(ValueError):
    """A file that is not a readable Jupyter notebook (format 4)."""


def graded_points(source: str) -> int | None:
    """The points of a cell marked `# GRADED: N points` (or `1 point`), else None."""
    match = GRADED_RE.search(source)
    return int(match.group(1)) if match else None


def graded_cells(nb: nbformat.NotebookNode) -> dict[int, int]:
    """{cell index: points} for every code cell marked `# GRADED: N points`."""
    return {
        i: points
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (points := graded_points(cell.source)) is not None
    }


def read_notebook(path: str | os.PathLike[str]) -> nbformat.NotebookNode:
    """Read and validate a format-4 notebook; NotebookReadError says what is wrong."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NotebookReadError(f"cannot read: {exc}") from exc
    return parse_notebook(text)


def parse_notebook(text: str) -> nbformat.NotebookNode:
    """A notebook from its JSON text, validated; NotebookReadError says what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotebookReadError(f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("nbformat") != 4:
        raise NotebookReadError("not a Jupyter notebook (expected a JSON object with nbformat 4)")
    # iter_validate only reads; nbformat.validate would first "repair" the dict, and
    # fails with KeyError or TypeError on some malformed ones.
    for error in iter_validate(data):
        raise NotebookReadError(f"not a valid notebook: {error.message}")
    nb = nbformat.from_dict(data)
    # What nbformat.reads does after parsing: multi-line strings stored as lists are joined.
    return strip_transient(rejoin_lines(nb))


def _error_text(ename: str, evalue: str) -> str:
    first_line = evalue.strip().splitlines()[0] if evalue.strip() else ""
    return f"{ename}: {first_line}" if first_line else ename


def execute_notebook(
    nb: nbformat.NotebookNode, cwd: str | os.PathLike[str], timeout_s: int
) -> dict[int, str | None]:
    """Run every code cell of `nb` in place, in a fresh kernel started in `cwd`.

    Returns, for each cell that ran, None or its error as "ExceptionName: message".
    A cell that runs past `timeout_s` is interrupted and counts as an error. Raises when
    the kernel cannot start or dies (nbclient's exceptions). The kernel talks over a
    local socket file (IPC), not TCP, so nothing listens on the network.
    """
    # imported here: only these tools need a kernel
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    errors: dict[int, str | None] = {}

    def on_cell_executed(cell, cell_index: int, execute_reply: dict) -> None:
        content = execute_reply["content"]
        failed = content.get("status") == "error"
        errors[cell_index] = (
            _error_text(content.get("ename", "Error"), content.get("evalue", ""))
            if failed
            else None
        )

    with tempfile.TemporaryDirectory(prefix="minillm-kernel-") as sockets:
        km = KernelManager(
            kernel_name=KERNEL_NAME, transport="ipc", ip=os.path.join(sockets, "kernel")
        )
        client = NotebookClient(
            nb,
            km=km,
            timeout=timeout_s,
            kernel_name=KERNEL_NAME,
            allow_errors=True,
            interrupt_on_timeout=True,
            error_on_timeout={
                "ename": "Timeout",
                "evalue": f"the cell ran longer than {timeout_s} s and was interrupted",
                "traceback": [],
            },
            record_timing=False,
            coalesce_streams=True,  # print() may arrive in pieces; stored outputs must not vary
            resources={"metadata": {"path": str(cwd)}},
            on_cell_executed=on_cell_executed,
        )
        try:
            client.execute()
        finally:
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    return errors
