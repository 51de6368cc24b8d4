"""scripts/gpu_validate.sh and its probes (minillm.lab.gpu_probes): the script parses,
refuses a machine without CUDA with one line, and in smoke mode runs its Python parts on a
CPU under Triton's interpreter, writing its results where $OUT says; a probe fails when a
kernel's output is wrong."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from minillm.lab import gpu_probes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_validate.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_a_bad_argument_is_refused():
    result = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: scripts/gpu_validate.sh" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_refuses_with_one_line(tmp_path):
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHON": sys.executable,
            "HOME": str(tmp_path),
            "OUT": str(tmp_path),
        },
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_smoke_mode_runs_the_python_parts_on_a_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(SCRIPT), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    probes = json.loads((tmp_path / "gpu_probes_cpu.json").read_text())
    assert probes["smoke"] and probes["machine"]["interpreter"]
    assert [(p["probe"], p["passed"]) for p in probes["probes"]] == [
        ("prefill", True),
        ("decode", True),
        ("matmul", True),
    ]
    assert all(p["error"] <= gpu_probes.TOLERANCE["float32"] for p in probes["probes"])
    lines = (tmp_path / "gpu_check_cpu.jsonl").read_text().splitlines()
    check = [json.loads(line) for line in lines]
    assert check[0]["budget_s"] == 30  # too little for any phase: each recorded as skipped
    assert [e["phase"] for e in check[1:3]] == ["w4a16", "decode"]
    assert {e["status"] for e in check[1:]} == {"skipped: no time left"}
    assert "== gpu_validate: done" in result.stdout


def test_a_wrong_kernel_fails_its_probe(monkeypatch):
    import kernels.paged_decode as paged_decode

    real = paged_decode.paged_decode_attention

    def off_by_a_little(*args, **kwargs):
        out = real(*args, **kwargs)
        return out + 1e-2 * out.abs().max()

    monkeypatch.setattr(paged_decode, "paged_decode_attention", off_by_a_little)
    results = gpu_probes.run(smoke=True)
    passed = {p["probe"]: p["passed"] for p in results["probes"]}
    assert passed == {"prefill": True, "decode": False, "matmul": True}


def test_a_missing_package_is_named_with_what_it_skips(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # importing it raises ImportError
    machine = gpu_probes.preflight(smoke=True)
    assert machine["packages"]["hypothesis"] is None
    assert machine["missing"] == [
        "hypothesis is missing: the test phases (property tests) will be skipped "
        "(pip install hypothesis)"
    ]
