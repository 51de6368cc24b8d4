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


# Attention sums softmax-weighted values: on a GPU the probabilities enter the second dot in
# the input dtype (one more rounding per term); under the interpreter every dot is float32.
ATTENTION_TOLERANCE = {
    torch.float32: 2e-5,
    torch.float16: 2e-3 if INTERPRETED else 1e-2,
    torch.bfloat16: 3e-2 if INTERPRETED else 6e-2,
}


def random_block_tables(
    num_seqs: int, max_num_blocks: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """[num_seqs, max_num_blocks] int32: each sequence's blocks, distinct and shuffled (so that
    logical and physical order differ), drawn from a pool of num_blocks."""
    rows = [torch.randperm(num_blocks, generator=gen)[:max_num_blocks] for _ in range(num_seqs)]
    return (
        torch.stack(rows).to(torch.int32)
        if rows
        else torch.zeros(0, max_num_blocks, dtype=torch.int32)
    )
