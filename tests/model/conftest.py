"""Model tests: `import kernels` first, so that without CUDA the kernels are defined under
Triton's interpreter (see kernels/__init__.py)."""

import pytest
import torch
from quant_testing import tiny_model

import kernels  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, before triton loads)
from minillm.model.llama import LlamaForCausalLM


@pytest.fixture
def model() -> LlamaForCausalLM:
    return tiny_model()


@pytest.fixture
def calibration() -> torch.Tensor:
    return torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(1))
