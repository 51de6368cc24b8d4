"""scripts/gpu_check.sh and minillm.lab.gpu_check: the plan fits its budget, a dry run prints
it on a CPU, a machine without CUDA is refused cleanly, and (run on a CPU with
GPU_CHECK_ALLOW_CPU=1, only for these tests) each phase is its own process, so a phase that
aborts is recorded as failed and the phases after it still run."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from minillm.lab import gpu_check

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NAMES = ["w4a16", "decode", "prefill", "mixed-step", "cuda-graphs", "kernel-tests", "gpu-tests"]
NAMES += ["oracles"]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize("budget", [1, 30, 60, 100, 200, 480, 600, 900, 3600])
def test_the_plan_fits_its_budget(budget):
    rows = gpu_check.plan(budget)
    assert [row["phase"] for row in rows] == NAMES
    assert gpu_check.RESERVE_S + sum(row["budget_s"] for row in rows) <= max(
        budget, gpu_check.RESERVE_S
    )
    assert all(row["budget_s"] == 0 or row["budget_s"] >= gpu_check.MIN_PHASE_S for row in rows)


def test_the_default_plan_runs_every_phase_within_a_15_minute_lease():
    assert gpu_check.DEFAULT_BUDGET_S == 480
    rows = gpu_check.plan(480)
    assert all(row["budget_s"] >= gpu_check.MIN_PHASE_S for row in rows)
    assert sum(row["budget_s"] for row in rows) + gpu_check.RESERVE_S <= 480
    # each goal is its own phase (its own process)
    assert {"w4a16", "decode", "prefill", "mixed-step"} <= {row["phase"] for row in rows}


def run_script(*args, env=None, timeout=120):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def test_the_dry_run_prints_the_plan_and_its_total():
    result = run_script("--dry-run", "--budget", "480")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for row in gpu_check.plan(480):
        line = next(ln for ln in lines if ln.split()[0] == row["phase"])
        assert f"{row['budget_s']} s" in line and row["measures"][:40] in line
    total = gpu_check.RESERVE_S + sum(row["budget_s"] for row in gpu_check.plan(480))
    assert lines[-1] == f"total at most {total} s of 480 s"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_a_real_run_is_refused_cleanly(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": sys.executable,
        "HOME": str(tmp_path),
        "OUT": str(tmp_path),
    }
    result = run_script("--budget", "480", env=env)
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("args", [["--fast"], ["--budget"]])
def test_a_bad_argument_is_refused(args):
    result = run_script(*args)
    assert result.returncode == 2 and "usage: scripts/gpu_check.sh" in result.stderr


def test_a_crashing_phase_is_recorded_and_the_later_phases_still_run(tmp_path, monkeypatch):
    """On a CPU, with every phase's command replaced by a short one: the injected fault
    (GPU_CHECK_FAIL_PHASE) aborts its process; the results file has its failure, written
    before the next phase started, and the next phases' entries."""
    ok = (sys.executable, "-c", "print('measured')")
    phases = tuple(gpu_check.Phase(p.name, p.share, p.measures, ok) for p in gpu_check.PHASES)
    monkeypatch.setattr(gpu_check, "PHASES", phases)
    monkeypatch.setenv("GPU_CHECK_ALLOW_CPU", "1")
    monkeypatch.setenv("GPU_CHECK_FAIL_PHASE", "decode")
    seen_before_each_phase = []
    real_run_phase = gpu_check.run_phase

    def spying(phase, budget_s, out):
        seen_before_each_phase.append((tmp_path / "gpu_check_cpu.jsonl").read_text())
        return real_run_phase(phase, budget_s, out)

    monkeypatch.setattr(gpu_check, "run_phase", spying)
    code = gpu_check.main(["--budget", "480", "--out", str(tmp_path)])
    assert code == 1
    lines = [json.loads(ln) for ln in (tmp_path / "gpu_check_cpu.jsonl").read_text().splitlines()]
    header, entries = lines[0], lines[1:]
    assert header["budget_s"] == 480 and header["plan"] == gpu_check.plan(480)
    assert {"nvidia_smi", "processes", "versions"} <= set(header["device"])
    assert [e["phase"] for e in entries] == NAMES
    status = {e["phase"]: (e["status"], e["exit_code"]) for e in entries}
    assert status["decode"] == ("failed", -6)  # SIGABRT, as a CUDA fault ends a process
    assert all(status[n] == ("passed", 0) for n in NAMES if n != "decode")
    # written as each phase ended: before phase i started, i entries were in the file
    assert [len(text.splitlines()) - 1 for text in seen_before_each_phase] == list(range(8))
    assert "simulated fault" in (tmp_path / "decode" / "log.txt").read_text()
    assert "measured" in (tmp_path / "prefill" / "log.txt").read_text()


def test_a_phase_past_its_budget_is_stopped_and_recorded(tmp_path, monkeypatch):
    slow = (sys.executable, "-c", "import time; time.sleep(60)")
    ok = (sys.executable, "-c", "pass")
    phases = (
        gpu_check.Phase("slow", 1.0, "sleeps", slow),
        gpu_check.Phase("after", 1.0, "returns", ok),
    )
    monkeypatch.setattr(gpu_check, "PHASES", phases)
    monkeypatch.setattr(gpu_check, "MIN_PHASE_S", 1)
    monkeypatch.setattr(
        gpu_check,
        "plan",
        lambda budget: [
            {"phase": "slow", "budget_s": 2, "measures": ""},
            {"phase": "after", "budget_s": 5, "measures": ""},
        ],
    )
    monkeypatch.setenv("GPU_CHECK_ALLOW_CPU", "1")
    assert gpu_check.main(["--budget", "60", "--out", str(tmp_path)]) == 1
    lines = [json.loads(ln) for ln in (tmp_path / "gpu_check_cpu.jsonl").read_text().splitlines()]
    assert [(e["phase"], e["status"]) for e in lines[1:]] == [
        ("slow", "timeout"),
        ("after", "passed"),
    ]
    assert lines[1]["seconds"] < 10


def test_phase_commands_name_real_benchmarks_and_options():
    """Every benchmark phase's --only names a benchmark kernel_bench knows."""
    from minillm.lab.kernel_bench import KERNEL_BENCHMARKS

    for phase in gpu_check.PHASES:
        if "minillm.lab.kernel_bench" in phase.command:
            start = phase.command.index("--only") + 1
            end = phase.command.index("--out")
            assert set(phase.command[start:end]) <= set(KERNEL_BENCHMARKS), phase


def test_it_finds_every_module_with_gpu_tests():
    """The gpu-tests phase collects exactly the modules outside tests/kernels whose tests
    are marked gpu (a module it missed would never run on a GPU)."""
    import re

    marked = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if not str(path.relative_to(ROOT)).startswith("tests/kernels/")
        and re.search(r"mark\.gpu\b", path.read_text())
    )
    assert marked and gpu_check.gpu_test_modules() == marked
    phase = next(p for p in gpu_check.PHASES if p.name == "gpu-tests")
    assert set(marked) <= set(phase.command)
