"""The Python code of the repository passes ruff's lint and format checks (pyproject.toml)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE = ["minillm", "kernels", "tests"]
RUFF = pathlib.Path(sys.executable).parent / "ruff"


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RUFF), *args, *CODE], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_ruff_lint_passes():
    result = ruff("check", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_the_code_unchanged():
    result = ruff("format", "--check", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
