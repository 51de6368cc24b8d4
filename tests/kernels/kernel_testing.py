"""What the kernel tests share: the device they run on, dtypes, and tolerances per dtype.

Tolerances (atol = rtol, elementwise, `torch.testing.assert_close`) are a few units in the
last place of the dtype the kernel stores, so that a wrong mask or a missed tile fails:
float32 1e-5 (2^-23 ~ 1.2e-7 spacing, plus a different summation order); float16 2e-3 (one
ulp is 2^-10 ~ 1e-3); bfloat16 3e-2 (one ulp is 2^-7 ~ 8e-3; Triton's interpreter truncates
float32 -> bfloat16 where a GPU rounds to nearest, so up to two ulps plus the reference's own
rounding). Kernels that sum long products (attention, matmul) state their own on top.
"""

from __future__ import annotations

import torch

from kernels import INTERPRETED

DEVICE = "cpu" if INTERPRETED else "cuda"
# bfloat16 on a GPU only where it has it (Ampere and later); the interpreter emulates it
DTYPES = [torch.float32, torch.float16] + (
    [torch.bfloat16] if INTERPRETED or torch.cuda.is_bf16_supported() else []
)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
