"""kernels.int8_gemm: the W8A8 kernel against the int64 oracle, and per-token quantization."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES

from kernels.int8_gemm import (
    MAX_K,
    quantize_per_token,
    w8a8_matmul,
    w8a8_matmul_reference,
)


def random_int8(rows, cols, gen, low=-127, high=127):
    return torch.randint(low, high + 1, (rows, cols), generator=gen, dtype=torch.int8)


@given(
    m=st.integers(0, 40),
    n=st.integers(0, 70),
    k=st.integers(0, 150),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_w8a8_matches_oracle(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qx, qw = random_int8(m, k, gen), random_int8(n, k, gen)
    x_scales = torch.rand(m, generator=gen) * 0.1
    w_scales = torch.rand(n, generator=gen) * 0.01
    args = [t.to(DEVICE) for t in (qx, x_scales, qw, w_scales)]
    out = w8a8_matmul(*args, out_dtype=dtype)
    expected = w8a8_matmul_reference(*args, out_dtype=dtype)
    assert out.dtype == dtype and out.shape == (m, n)
    # the integer sum is exact in both; the only difference is the float rounding of the
    # epilogue (float32 products) and the final store: a few units in the last place
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=1e-30)


def test_w8a8_integer_sum_is_exact_at_the_extremes():
    """Every code at +-127 along a long K: the sum is 127^2 K, beyond float32's 2^24 where a
    float accumulator would round; the int32 one does not."""
    k, m, n = 2048, 3, 5
    qx = torch.full((m, k), 127, dtype=torch.int8)
    qx[1] = -127
    qw = torch.full((n, k), 127, dtype=torch.int8)
    qw[:, ::2] = -127  # alternate signs in row 0..n: sum 0
    qw[2] = 127
    ones_m, ones_n = torch.ones(m), torch.ones(n)
    args = [t.to(DEVICE) for t in (qx, ones_m, qw, ones_n)]
    out = w8a8_matmul(*args).cpu().double()
    expected = qx.double() @ qw.double().T  # small integers: exact in float64
    assert float(expected.abs().max()) == 127 * 127 * k > 2**24
    # scales of 1: the float32 output holds the exact integer as closely as float32 can
    assert torch.equal(out, expected.float().double())


def test_w8a8_rejects_bad_inputs():
    qx = torch.zeros(2, 8, dtype=torch.int8, device=DEVICE)
    qw = torch.zeros(3, 8, dtype=torch.int8, device=DEVICE)
    xs, ws = torch.ones(2, device=DEVICE), torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match="qx"):
        w8a8_matmul(qx.float(), xs, qw, ws)
    with pytest.raises(ValueError, match="K differs"):
        w8a8_matmul(qx, xs, qw[:, :4].contiguous(), ws)
    with pytest.raises(ValueError, match="x_scales"):
        w8a8_matmul(qx, ws, qw, ws)
    with pytest.raises(ValueError, match="w_scales"):
        w8a8_matmul(qx, xs, qw, ws.double())
    with pytest.raises(ValueError, match="out_dtype"):
        w8a8_matmul(qx, xs, qw, ws, out_dtype=torch.int32)
    wide = torch.zeros(1, MAX_K + 1, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="overflow"):
        w8a8_matmul(wide, xs[:1], wide, xs[:1])


@given(
    m=st.integers(1, 12),
    k=st.integers(1, 64),
    seed=st.integers(0, 2**16),
    spread=st.floats(1e-3, 1e3),
)
def test_quantize_per_token_error_bound(m, k, seed, spread):
    """Each row's codes reach +-127 at its largest |x| and round every entry to within half a
    step of that row's scale."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * spread
    codes, scales = quantize_per_token(x)
    assert codes.dtype == torch.int8 and scales.shape == (m,)
    torch.testing.assert_close(scales, x.abs().amax(dim=1) / 127)
    assert torch.equal(codes.abs().amax(dim=1), torch.full((m,), 127, dtype=torch.int8))
    error = (codes.float() * scales[:, None] - x).abs()
    assert bool((error <= scales[:, None] / 2 * (1 + 1e-5)).all())


def test_quantize_per_token_zero_row():
    x = torch.zeros(2, 5)
    x[1] = torch.arange(5.0)
    codes, scales = quantize_per_token(x)
    assert scales[0] == 0 and not codes[0].any()
    assert codes[1].tolist() == [0, 32, 64, 95, 127]  # 127 * [0, .25, .5, .75, 1], rounded
