"""W8A8 matmul: int8 activations times int8 weights, int32 accumulation, scales in the epilogue.

Math. A linear layer computes y = x W^T with x: [M, K] and W: [N, K]. W8A8 quantizes both
operands to int8, symmetrically:

- the weights once, per output channel: sw_n = max_k |W[n, k]| / 127, qw = round(W / sw_n);
- the activations on every call, per token (dynamic): sx_m = max_k |x[m, k]| / 127,
  qx = round(x / sx_m) (`quantize_per_token`).

Then y[m, n] ~ sx_m sw_n sum_k qx[m, k] qw[n, k]: both scales factor out of the K sum, so
the sum is a pure integer dot product, which int8 tensor cores (and `tl.dot` of two int8
tiles) compute exactly in int32, and the two scales are applied once per output element
after the K loop (the epilogue). Each product is at most 127^2 = 16,129 in magnitude, so
the int32 sum cannot overflow below K = MAX_K = 133,144 input channels.

What W8A8 buys over W8A16: the GEMM itself runs on the int8 tensor cores, at twice the
bfloat16 rate on A100/H100-class GPUs, which is what a compute-bound prefill or a large
decode batch needs; the weight bytes are the same as W8A16's. The cost is the activations'
rounding, which is large where a few input channels carry outliers (see SmoothQuant,
`minillm.model.quantization.smoothquant`).

Tiling: one program per [BLOCK_M, BLOCK_N] output tile walks K in BLOCK_K steps with an
int32 accumulator (compiled, the int8 dots run on the integer tensor cores from Ampere on:
mma.sync, and wgmma on Hopper; `supported` says where); no split-K (the result is exact in
any order, so a split would only matter for speed). Under the interpreter the int8 dot runs
in NumPy, exactly as well.

Cost per call: FLOPs (integer ops) 2 M N K; bytes moved: qx and qw once (M K + N K), the
scales (4 M + 4 N) and y written (M N * itemsize).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import INTERPRETED
from kernels.checks import check_contiguous, check_device, check_dtype, check_same_device
from kernels.device import compute_capability

INT8_MAX = 127
MAX_K = (2**31 - 1) // (INT8_MAX * INT8_MAX)  # the int32 accumulator cannot overflow below
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (qx [M, K] int8 in [-127, 127], scales [M] float32), one scale per
    row (token): s_m = max_k |x[m, k]| / 127. A row of zeros gets scale 0 and codes 0."""
    if x.dim() != 2:
        raise ValueError(f"x must have shape [M, K], got {list(x.shape)}")
    x32 = x.float()
    scales = x32.abs().amax(dim=1) / INT8_MAX if x.shape[1] else x32.new_zeros(x.shape[0])
    divisor = torch.where(scales == 0, 1.0, scales)
    codes = (x32 / divisor[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


@triton.jit
def _w8a8_kernel(
    qx_ptr,
    qw_ptr,
    x_scales_ptr,
    w_scales_ptr,
    out_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        qx = tl.load(  # [BLOCK_M, BLOCK_K] int8
            qx_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0,
        )
        qw = tl.load(  # [BLOCK_K, BLOCK_N] int8: W^T's tile
            qw_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0,
        )
        acc += tl.dot(qx, qw, out_dtype=tl.int32)  # exact integer products and sums
    # epilogue: the per-token and per-channel scales, once per output element
    x_scales = tl.load(x_scales_ptr + rows, mask=row_mask, other=0.0)
    w_scales = tl.load(w_scales_ptr + cols, mask=col_mask, other=0.0)
    out = acc.to(tl.float32) * x_scales[:, None] * w_scales[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _check_w8a8_inputs(qx, x_scales, qw, w_scales, out_dtype) -> None:
    for name, t in (("qx", qx), ("qw", qw)):
        check_dtype(name, t, (torch.int8,))
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {list(t.shape)}")
    for name, t in (("x_scales", x_scales), ("w_scales", w_scales)):
        check_dtype(name, t, (torch.float32,))
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {list(t.shape)}")
    m, k = qx.shape
    n = qw.shape[0]
    if qw.shape[1] != k:
        raise ValueError(f"qx is [{m}, {k}] but qw is {list(qw.shape)}: K differs")
    if x_scales.shape[0] != m or w_scales.shape[0] != n:
        raise ValueError(
            f"x_scales must be [{m}] and w_scales [{n}], got {list(x_scales.shape)} "
            f"and {list(w_scales.shape)}"
        )
    if k > MAX_K:
        raise ValueError(f"K = {k} could overflow the int32 accumulator (at most {MAX_K})")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    check_device("qx", qx)
    for name, t in (("qx", qx), ("qw", qw), ("x_scales", x_scales), ("w_scales", w_scales)):
        check_same_device(name, t, qx)
        check_contiguous(name, t)


def supported(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: under the interpreter always; on a GPU from
    compute capability 8.0 (Ampere), where Triton lowers an int8 dot to the integer tensor
    cores (it cannot compile one for Turing, sm_75)."""
    if INTERPRETED:
        return True
    cc = compute_capability(device)
    return cc is not None and cc >= (8, 0)


def launch_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): thin tiles for decode-sized M, where
    the weights dominate; square ones for prefill (int8 tiles are half the bytes of bfloat16
    ones, so a 3-stage pipeline fits in shared memory on every GPU Triton supports)."""
    if INTERPRETED:
        return 16, 32, 32, 4, 1
    if m <= 16:
        return 16, 64, 128, 4, 3
    return 128, 128, 64, 8, 3


def w8a8_matmul(
    qx: torch.Tensor,
    x_scales: torch.Tensor,
    qw: torch.Tensor,
    w_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """y[m, n] = x_scales[m] w_scales[n] sum_k qx[m, k] qw[n, k], summed in int32.

    qx: [M, K] int8 (from `quantize_per_token`); x_scales: [M] float32; qw: [N, K] int8;
    w_scales: [N] float32; all contiguous on one device. Returns [M, N] in out_dtype."""
    _check_w8a8_inputs(qx, x_scales, qw, w_scales, out_dtype)
    if not supported(qx.device):
        raise ValueError(
            "the W8A8 kernel needs int8 tensor-core dots (compute capability 8.0 or later)"
        )
    m, k = qx.shape
    n = qw.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=qx.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m, block_n, block_k, num_warps, num_stages = launch_config(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_kernel[grid](
        qx,
        qw,
        x_scales,
        w_scales,
        out,
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def w8a8_matmul_reference(
    qx: torch.Tensor,
    x_scales: torch.Tensor,
    qw: torch.Tensor,
    w_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The oracle, plain PyTorch on the CPU: the integer dot products in int64 (exact, no
    overflow possible), then both scales in float64, rounded once to out_dtype."""
    dots = qx.cpu().long() @ qw.cpu().long().T
    y = dots.double() * x_scales.cpu().double()[:, None] * w_scales.cpu().double()[None, :]
    return y.to(out_dtype).to(qx.device)


def w8a8_matmul_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def w8a8_matmul_bytes(m: int, n: int, k: int, out_itemsize: int) -> int:
    """qx and qw read once (1 byte each), float32 scales, y written."""
    return m * k + n * k + 4 * (m + n) + m * n * out_itemsize
