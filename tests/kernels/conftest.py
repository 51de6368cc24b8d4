"""Kernel tests: `import kernels` first, so that without CUDA the kernels are defined under
Triton's interpreter (see kernels/__init__.py).

MINILLM_KERNEL_EXAMPLES=n sets the hypothesis budget of these tests (scripts/gpu_check.sh
uses a small one: compiled for a GPU, every new shape class is a compile of its own)."""

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
