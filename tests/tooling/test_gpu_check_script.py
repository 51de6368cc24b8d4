"""scripts/gpu_check.sh: parses, refuses a machine without CUDA, and finds the GPU tests."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_exits_2_and_says_why(tmp_path):
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)},
        check=False,
    )
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr
    assert not (ROOT / "benchmarks" / "results" / "gpu_tests_cpu.txt").exists()


def test_it_finds_every_module_with_gpu_tests():
    """The script's grep, run here, lists the modules that hold tests marked gpu."""
    line = next(ln for ln in SCRIPT.read_text().splitlines() if "grep -rlE" in ln)
    pattern = re.search(r'grep -rlE "([^"]+)"', line).group(1).replace("\\\\", "\\")
    found = subprocess.run(
        ["grep", "-rlE", pattern, "tests", "--include=test_*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    marked = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"@pytest\.mark\.gpu\b|pytestmark\s*=.*mark\.gpu", path.read_text())
    )
    assert marked and sorted(found) == marked
