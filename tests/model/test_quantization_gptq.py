"""GPTQ against hand-written float64 computations, and against round-to-nearest on the
calibration data it was given."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from quant_testing import output_error

from minillm.model.quantization.gptq import gptq, gptq_quantize
from minillm.model.quantization.rtn import (
    INT8_PER_CHANNEL,
    QuantSpec,
    dequantize,
    find_grid,
    int4_spec,
    quantize,
    rtn,
)

PER_ROW_INT4 = QuantSpec(bits=4, group_size=None, symmetric=False)


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X^T X / T, in X's dtype."""
    return 2 * x.T @ x / x.shape[0]


def nearest(w, s, z, spec):
    """The nearest code on the grid, written out (the oracles' own rounding)."""
    return torch.clamp(torch.round(w / s) + z, spec.q_min, spec.q_max)


def test_one_column_update_equals_the_float64_formula():
    """Column 1 is rounded; column 2 moves by -(w1 - w^1) [H^-1]_12 / [H^-1]_11 (OBS), then
    is rounded. H^-1 here is an explicit float64 inverse of the dampened Hessian."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, dtype=torch.float64, generator=gen) @ torch.tensor(
        [[1.0, 0.9], [0.0, 0.5]], dtype=torch.float64
    )  # correlated inputs: the update is large
    w = torch.randn(64, 2, dtype=torch.float64, generator=gen) * 0.1
    H = hessian_of(x)
    scales = torch.full((64, 1), 0.02, dtype=torch.float64)
    zeros = torch.full((64, 1), 8.0, dtype=torch.float64)
    codes = gptq_quantize(w, H, scales, zeros, PER_ROW_INT4, damp_percent=0.01)

    damped = H + 0.01 * H.diagonal().mean() * torch.eye(2, dtype=torch.float64)
    Hinv = torch.linalg.inv(damped)
    q1 = nearest(w[:, 0], 0.02, 8.0, PER_ROW_INT4)
    w2 = w[:, 1] - (w[:, 0] - (q1 - 8.0) * 0.02) * Hinv[0, 1] / Hinv[0, 0]
    q2 = nearest(w2, 0.02, 8.0, PER_ROW_INT4)
    assert torch.equal(codes[:, 0], q1.int()) and torch.equal(codes[:, 1], q2.int())
    # not vacuous: the update changed some rows' second code away from plain rounding
    assert (q2 != nearest(w[:, 1], 0.02, 8.0, PER_ROW_INT4)).sum() >= 5


def obq_reference(w, H, scales, zeros, spec, group_size, damp_percent, act_order):
    """Optimal Brain Quantization as first written: after each column, invert the dampened
    Hessian of the columns still to quantize, and move them by OBS's optimal update."""
    W = w.double().clone()
    H = H.double() + damp_percent * H.double().diagonal().mean() * torch.eye(H.shape[0]).double()
    k = W.shape[1]
    order = torch.argsort(H.diagonal(), descending=True).tolist() if act_order else range(k)
    remaining = list(order)
    codes = torch.zeros_like(W)
    for c in order:
        Hinv = torch.linalg.inv(H[remaining][:, remaining])  # c is remaining[0]
        s, z = scales[:, c // group_size].double(), zeros[:, c // group_size].double()
        codes[:, c] = nearest(W[:, c], s, z, spec)
        err = W[:, c] - (codes[:, c] - z) * s
        W[:, remaining] -= err[:, None] * (Hinv[0] / Hinv[0, 0])[None, :]
        remaining.remove(c)
    return codes.int()


@given(
    n=st.integers(1, 8),
    num_groups=st.integers(1, 3),
    group_size=st.sampled_from([2, 4]),
    block_size=st.sampled_from([1, 3, 128]),
    act_order=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gptq_with_cholesky_and_lazy_batches_equals_obq_in_float64(
    n, num_groups, group_size, block_size, act_order, seed
):
    gen = torch.Generator().manual_seed(seed)
    k = num_groups * group_size
    x = torch.randn(3 * k, k, dtype=torch.float64, generator=gen)
    x = x * torch.rand(k, dtype=torch.float64, generator=gen) * 3  # unequal channel energies
    H = hessian_of(x)
    w = torch.randn(n, k, dtype=torch.float64, generator=gen) * 0.1
    spec = int4_spec(group_size)
    scales, zeros = find_grid(w, spec)
    scales, zeros = scales.double(), zeros.double()
    codes = gptq_quantize(w, H, scales, zeros, spec, block_size, 0.01, act_order)
    expected = obq_reference(w, H, scales, zeros, spec, group_size, 0.01, act_order)
    assert torch.equal(codes, expected)


@given(
    n=st.integers(1, 12),
    k=st.sampled_from([32, 64]),
    t=st.integers(2, 96),
    correlated=st.booleans(),
    act_order=st.booleans(),
    int8=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gptq_never_reconstructs_the_calibration_outputs_worse_than_rtn(
    n, k, t, correlated, act_order, int8, seed
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen)
    if correlated:
        x = x @ torch.randn(k, k, generator=gen) * 0.3
    w = torch.randn(n, k, generator=gen) * 0.1
    spec = INT8_PER_CHANNEL if int8 else int4_spec(32)
    codes, scales, zeros = gptq(w, hessian_of(x), spec, act_order=act_order)
    rounded, rtn_scales, rtn_zeros = rtn(w, spec)
    assert torch.equal(scales, rtn_scales) and torch.equal(zeros, rtn_zeros)  # RTN's grid
    gptq_error = output_error(x, w, dequantize(codes, scales, zeros))
    rtn_error = output_error(x, w, dequantize(rounded, scales, zeros))
    # the rows are compared through float32 H; allow its rounding, nothing more
    assert gptq_error <= rtn_error * (1 + 1e-4) + 1e-9


def test_raw_gptq_can_lose_to_rtn_on_a_row_which_the_guard_repairs():
    """Why `gptq` compares rows: GPTQ is greedy, and here one row of its raw result has twice
    round-to-nearest's error on the calibration data (the layer as a whole has a third)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32, dtype=torch.float64, generator=gen)
    w = torch.randn(8, 32, generator=gen) * 0.1
    H = hessian_of(x).float()
    spec = int4_spec(32)
    scales, zeros = find_grid(w, spec)
    raw = dequantize(gptq_quantize(w, H, scales, zeros, spec), scales, zeros)
    nearest_w = dequantize(quantize(w, scales, zeros, spec), scales, zeros)
    raw_rows = [output_error(x, w[i : i + 1], raw[i : i + 1]) for i in range(8)]
    rtn_rows = [output_error(x, w[i : i + 1], nearest_w[i : i + 1]) for i in range(8)]
    assert max(r / q for r, q in zip(raw_rows, rtn_rows, strict=True)) > 2
    assert sum(raw_rows) < 0.5 * sum(rtn_rows)
    guarded = dequantize(*gptq(w, H, spec))
    for i in range(8):
        assert output_error(x, w[i : i + 1], guarded[i : i + 1]) <= rtn_rows[i] * (1 + 1e-5)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_clearly_on_correlated_inputs(act_order):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen) @ torch.randn(128, 128, generator=gen) * 0.2
    w = torch.randn(64, 128, generator=gen) * 0.05
    spec = int4_spec(32)
    codes, scales, zeros = gptq(w, hessian_of(x), spec, act_order=act_order)
    rounded = quantize(w, scales, zeros, spec)
    gptq_error = output_error(x, w, dequantize(codes, scales, zeros))
    assert gptq_error < 0.6 * output_error(x, w, dequantize(rounded, scales, zeros))


def test_bad_arguments_are_refused():
    w = torch.zeros(2, 4)
    scales, zeros = find_grid(w, PER_ROW_INT4)
    with pytest.raises(ValueError, match="hessian must be"):
        gptq_quantize(w, torch.eye(3), scales, zeros, PER_ROW_INT4)
    with pytest.raises(ValueError, match="block_size"):
        gptq_quantize(w, torch.eye(4), scales, zeros, PER_ROW_INT4, block_size=0)
    # an input channel the calibration never used: H_ii = 0 must not break the factorization
    H = torch.eye(4)
    H[2, 2] = 0.0
    codes = gptq_quantize(torch.randn(2, 4), H, scales, zeros, PER_ROW_INT4, damp_percent=0.0)
    assert codes.shape == (2, 4)
