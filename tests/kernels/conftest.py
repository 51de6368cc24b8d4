"""Kernel tests: `import kernels` first, so that without CUDA the kernels are defined under
Triton's interpreter (see kernels/__init__.py)."""

import sys
from pathlib import Path

import kernels  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, before any kernel exists)

# the engine tests' tiny checkpoint builder, for the backend's end-to-end test
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
