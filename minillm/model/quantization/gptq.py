"""GPTQ: choose each column's codes so that the columns after it make up for its error.

Frantar et al., 2023, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (after Optimal Brain Quantization, Frantar & Alistarh, 2022).

Goal: for a linear layer W: [N, K] and calibration inputs X: [T, K], find codes whose
dequantized weights W^ minimize the layer's output error on the calibration data,

    ||X W^T - X W^^T||^2 = sum_n (w_n - w^_n)^T H (w_n - w^_n) / 2,   H = 2 X^T X.

The error of one row depends on H only, the same for every row. GPTQ quantizes the columns
one at a time, in a fixed order. When column i is rounded to q_i (error e = w_i - q_i), the
weights not yet quantized absorb it in the least-squares optimal way (Optimal Brain
Surgeon's update, restricted to the remaining columns F):

    w_F <- w_F - e / [H_F^-1]_ii * [H_F^-1]_{i, F}.

Recomputing H_F^-1 after every column would cost O(K^3) per column. GPTQ's observation: the
rows of the upper Cholesky factor U of H^-1 (H^-1 = U^T U) are exactly the vectors this
update needs, in order: [H_F^-1]_{i, F} / [H_F^-1]_ii = U_{i, F} / U_ii when F holds the
columns from i on. So one Cholesky factorization serves every step:

    err_i = (w_i - q_i) / U_ii;   w_j <- w_j - err_i U_ij   for j > i.

Lazy batch updates: the update of column j > i only matters when column j is quantized. So
columns are processed in blocks of 128: inside a block the updates are applied column by
column (to the block only), and the columns after the block receive the whole block's
updates at once, as one matrix product Err_block @ U_block,after. Same result, far fewer
memory passes.

Dampening: H + lambda I with lambda = 1% of the mean diagonal, so that H is safely
invertible when the calibration data does not span every input direction. Act-order:
quantize the columns in descending order of H_ii (the inputs with the largest activations
first, while the most columns remain to absorb their error). The grid (scales, zero points)
of every group is fixed beforehand from the original weights — RTN's grid, "static groups"
— so GPTQ differs from RTN only in which codes it chooses, and act-order changes the order
of the work but not the layout: the groups stay contiguous, and inference costs the same.

GPTQ is greedy: each column's error is compensated as well as possible, but rounding the
compensated columns can leave a row above plain rounding's error (a few percent of the rows
of small random layers, in this package's tests). Here each
row keeps whichever of the two has the smaller error on the calibration data
(`keep_better_rows`), which costs one [N, K] x [K, K] product per layer.
"""

from __future__ import annotations

import torch

from minillm.model.quantization.rtn import (
    QuantSpec,
    dequantize,
    expand_groups,
    find_grid,
    quantize,
    round_to_grid,
)

BLOCK_SIZE = 128
DAMP_PERCENT = 0.01


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    spec: QuantSpec,
    block_size: int = BLOCK_SIZE,
    damp_percent: float = DAMP_PERCENT,
    act_order: bool = False,
) -> torch.Tensor:
    """GPTQ's codes for w: [N, K] on the grid (scales, zeros: [N, G]), given the Hessian
    H = 2 X^T X / T: [K, K] of the calibration inputs. Returns codes [N, K] int32.

    Works in H's dtype (float64 for exact comparisons, else float32).
    """
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}], got {list(hessian.shape)}")
    if block_size < 1 or damp_percent < 0:
        raise ValueError("block_size must be >= 1 and damp_percent >= 0")
    dtype = torch.float64 if hessian.dtype == torch.float64 else torch.float32
    H = hessian.to(dtype).clone()
    dead = H.diagonal() == 0  # an input that is always 0: any weight serves, keep H invertible
    H[dead, dead] = 1.0
    order = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(k)
    W = w.to(dtype)[:, order].clone()
    H = H[order][:, order]
    size = spec.group_size_for(k)
    col_scales = expand_groups(scales, size)[:, order].to(dtype)
    col_zeros = expand_groups(zeros, size)[:, order].to(dtype)

    H.diagonal().add_(damp_percent * H.diagonal().mean())
    # U: the upper Cholesky factor of H^-1 (H^-1 = U^T U)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    Q = torch.zeros(n, k, dtype=torch.int32, device=w.device)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        W1 = W[:, b0:b1].clone()
        Err1 = torch.zeros_like(W1)
        for i in range(b1 - b0):
            c = b0 + i
            s, z = col_scales[:, c], col_zeros[:, c]
            q = round_to_grid(W1[:, i], s, z, spec)
            Q[:, c] = q
            err = (W1[:, i] - (q.to(dtype) - z) * s) / U[c, c]
            # error feedback: the block's later columns absorb this column's error
            W1[:, i:] -= err[:, None] * U[c, c:b1][None, :]
            Err1[:, i] = err
        # lazy batch update: the columns after the block get the block's updates at once
        W[:, b1:] -= Err1 @ U[b0:b1, b1:]
    return Q[:, torch.argsort(order)]


def row_errors(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """Each row's output error on the calibration data: (w - w^)^T H (w - w^), [N]."""
    d = (w.float() - w_hat.float()).to(hessian.dtype)
    return ((d @ hessian) * d).sum(dim=1)


def keep_better_rows(
    w: torch.Tensor,
    hessian: torch.Tensor,
    candidate: torch.Tensor,
    fallback: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
) -> torch.Tensor:
    """Per row, the codes (same grid) whose weights reconstruct the calibration outputs
    better; ties keep `candidate`."""
    worse = row_errors(w, dequantize(candidate, scales, zeros), hessian) > row_errors(
        w, dequantize(fallback, scales, zeros), hessian
    )
    return torch.where(worse[:, None], fallback, candidate)


def gptq(
    w: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantSpec,
    block_size: int = BLOCK_SIZE,
    damp_percent: float = DAMP_PERCENT,
    act_order: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize w: [N, K] with GPTQ on RTN's grid -> (codes [N, K], scales [N, G], zeros
    [N, G]), scales to be stored in `dtype`; a row whose GPTQ error exceeds RTN's keeps
    RTN's codes."""
    scales, zeros = find_grid(w, spec, dtype)
    codes = gptq_quantize(w, hessian, scales, zeros, spec, block_size, damp_percent, act_order)
    rounded = quantize(w, scales, zeros, spec)
    return keep_better_rows(w, hessian, codes, rounded, scales, zeros), scales, zeros
