"""scripts/gpu_check.sh: parses, refuses a machine without CUDA, finds the GPU tests, and
(run on a CPU with GPU_CHECK_ALLOW_CPU=1, only for this test) runs its phases under the
time budget, recording each in its results file and copying them into $OUT."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PHASES = ["kernels", "bench", "gpu-tests", "oracles", "sweeps", "bench-full"]


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
    assert not list((ROOT / "benchmarks" / "results").glob("gpu_check_cpu.*"))


def test_a_bad_argument_is_refused():
    result = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: scripts/gpu_check.sh" in result.stderr


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


def run_on_cpu(tmp_path, budget: int) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_ALLOW_CPU": "1",
        "GPU_CHECK_RESULTS": str(tmp_path / "results"),
        "OUT": str(out),
    }
    result = subprocess.run(
        ["bash", str(SCRIPT), "--budget", str(budget)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=budget + 120,
    )
    results = json.loads((tmp_path / "results" / "gpu_check_cpu.json").read_text())
    log = (tmp_path / "results" / "gpu_check_cpu.log").read_text()
    # what a remote run hands back: the same files in $OUT
    assert (out / "gpu_check_cpu.json").read_text() == json.dumps(results, indent=2)
    return result, results, log


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_with_no_time_left_every_phase_is_recorded_as_skipped(tmp_path):
    result, results, log = run_on_cpu(tmp_path, budget=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [p["phase"] for p in results["phases"]] == PHASES
    statuses = {p["status"] for p in results["phases"]}
    assert statuses <= {"skipped: no time left", "skipped: pytest or hypothesis missing"}
    # the machine and versions come first, whatever follows
    assert results["budget_s"] == 30 and results["versions"]["torch"] == torch.__version__
    assert results["versions"]["packages"]["pytest"] and results["date"]
    assert "== done" in log


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_phases_run_in_order_within_the_budget(tmp_path):
    result, results, log = run_on_cpu(tmp_path, budget=110)
    phases = {p["phase"]: p for p in results["phases"]}
    assert list(phases) == PHASES
    # the kernels' GPU tests are collected and skipped here (no GPU), and counted
    assert phases["kernels"]["status"] == "passed"
    assert phases["kernels"]["tests"]["tests"] == phases["kernels"]["tests"]["skipped"] > 10
    # the benchmark refuses a CPU: a failed phase, and the run goes on
    assert phases["bench"]["status"] == "failed" and phases["bench"]["exit_code"] == 2
    assert phases["sweeps"]["status"] == "failed"
    assert sum(p["seconds"] for p in results["phases"]) <= 110
    assert result.returncode == 1
    assert all(f"== {name}: " in log for name in PHASES)
