"""Kernel tests: `import kernels` first, so that without CUDA the kernels are defined under
Triton's interpreter (see kernels/__init__.py).

MINILLM_KERNEL_EXAMPLES=n sets the hypothesis budget of these tests (scripts/gpu_check.sh
uses a small one: compiled for a GPU, every new shape class is a compile of its own)."""

import json
import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

import kernels  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, before any kernel exists)

# the engine tests' tiny checkpoint builder, for the backend's end-to-end test
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

if "MINILLM_KERNEL_EXAMPLES" in os.environ:
    settings.register_profile(
        "kernels",
        max_examples=int(os.environ["MINILLM_KERNEL_EXAMPLES"]),
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile("kernels")


def pytest_runtest_logreport(report):
    """With MINILLM_TEST_REPORT set, one JSON line per test outcome, written as it happens:
    a timed GPU run that is cut short still says which tests passed and failed."""
    path = os.environ.get("MINILLM_TEST_REPORT")
    if not path or "PYTEST_XDIST_WORKER" in os.environ:  # pytest-xdist: its controller writes
        return
    if report.when != "call" and report.outcome == "passed":
        return
    line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
    line["seconds"] = round(report.duration, 2)
    if report.failed:
        line["message"] = str(report.longrepr)[-500:]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
