"""RMSNorm, optionally fused with the residual add that precedes it.

Math (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization"), per row x of length
n = hidden_size:

    y = x / sqrt(mean(x^2) + eps) * weight

With a residual, a pre-norm block's `h = x + residual; y = rmsnorm(h)` becomes one kernel
that returns both y and h: h is rounded to the input dtype first, exactly as the unfused
add would store it, and the statistics are taken in float32. The normalized row is rounded
to the input dtype before the weight multiplies it, as Hugging Face's LlamaRMSNorm does, so
the kernel and the engine's torch RMSNorm round the same way (they differ only in the order
in which the squares are summed).

Tiling: one program per row; the whole row sits in registers (BLOCK = hidden_size rounded up
to a power of two), so x is read once and y written once. Fusion is the point: unfused, the
add writes h and the norm reads it back, 2 * n * itemsize more bytes per row.

Cost per call (rows = x.numel() / n, b = itemsize): bytes moved rms_norm_bytes(): rows * n *
b for x and y each, n * b for the weight, plus 2 * rows * n * b with a residual (read it,
write h); FLOPs rms_norm_flops(): 4 per element (square, sum, scale, weight), plus 1 for the
residual add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import (
    check_contiguous,
    check_device,
    check_dtype,
    check_same_device,
    check_shape,
)

# a row sits in one program's registers: 32768 is the longest that compiles without spilling
# (16 warps; 65536 spills), above the largest models' hidden sizes (16384 to 18432)
MAX_HIDDEN_SIZE = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    offsets = row * hidden_size + cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        # rounded to the storage dtype, as the unfused `x + residual` would be
        x = (x + residual).to(dtype)
        tl.store(residual_out_ptr + offsets, x, mask=mask)
        x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.rsqrt(mean_square + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + offsets, y.to(dtype), mask=mask)


def num_warps_for(block: int) -> int:
    """Warps for a BLOCK-element row: about 8 elements per thread, 1 to 16 warps."""
    return min(max(block // 256, 1), 16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., hidden_size]; weight: [hidden_size] -> y like x.

    With `residual` (shaped like x): returns (rmsnorm(x + residual), x + residual).
    float16, bfloat16 or float32; x, weight and residual share dtype and device.
    """
    check_dtype("x", x, (torch.float16, torch.bfloat16, torch.float32))
    hidden_size = x.shape[-1] if x.dim() > 0 else 0
    if x.dim() < 1 or not 0 < hidden_size <= MAX_HIDDEN_SIZE:
        raise ValueError(
            f"x must have shape [..., hidden_size] with 0 < hidden_size <= {MAX_HIDDEN_SIZE}, "
            f"got {tuple(x.shape)}"
        )
    check_device("x", x)
    check_shape("weight", weight, (hidden_size,))
    check_dtype("weight", weight, (x.dtype,))
    check_same_device("weight", weight, x)
    check_contiguous("x", x)
    check_contiguous("weight", weight)
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
        check_dtype("residual", residual, (x.dtype,))
        check_same_device("residual", residual, x)
        check_contiguous("residual", residual)

    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    num_rows = x.numel() // hidden_size
    if num_rows > 0:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_rows,)](
            x,
            residual if residual is not None else x,  # unused without HAS_RESIDUAL
            weight,
            out,
            residual_out if residual_out is not None else out,
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps_for(block),
        )
    return out if residual_out is None else (out, residual_out)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The oracle: the same contract as `rms_norm`, in plain PyTorch."""
    if residual is not None:
        h = x + residual
        return rms_norm_reference(h, weight, eps), h
    x32 = x.float()
    normed = x32 / torch.sqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype)


def rms_norm_bytes(num_rows: int, hidden_size: int, itemsize: int, residual: bool) -> int:
    """Bytes one call moves: read x (and residual), write y (and h), read the weight once."""
    row_passes = 4 if residual else 2
    return (row_passes * num_rows * hidden_size + hidden_size) * itemsize


def rms_norm_flops(num_rows: int, hidden_size: int, residual: bool) -> int:
    """FLOPs one call does: square, sum, scale and weight per element, plus the add."""
    return (5 if residual else 4) * num_rows * hidden_size
