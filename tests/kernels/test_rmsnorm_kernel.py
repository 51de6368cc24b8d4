"""kernels.rmsnorm against its PyTorch reference, and the engine's RMSNorm."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES, TOLERANCE, assert_close

from kernels.rmsnorm import rms_norm, rms_norm_bytes, rms_norm_flops, rms_norm_reference


@settings(max_examples=15)
@given(
    num_rows=st.integers(0, 9),
    hidden_size=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    fused_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_reference(num_rows, hidden_size, dtype, fused_residual, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden_size, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(hidden_size, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(num_rows, hidden_size, generator=gen).to(DEVICE, dtype)
    tol = TOLERANCE[dtype]
    if fused_residual:
        y, h = rms_norm(x, weight, 1e-5, residual)
        y_ref, h_ref = rms_norm_reference(x, weight, 1e-5, residual)
        assert_close(h, h_ref, tol)
    else:
        y, y_ref = rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5)
    assert_close(y, y_ref, tol)


def test_rms_norm_of_a_worked_example():
    # mean(x^2) = (9 + 16) / 2 = 12.5; x / sqrt(12.5) * [1, 2] = [0.8485, 2.2627]
    x = torch.tensor([[3.0, -4.0]], device=DEVICE)
    y = rms_norm(x, torch.tensor([1.0, 2.0], device=DEVICE), 0.0)
    expected = torch.tensor([[3.0, -8.0]]) / 12.5**0.5
    torch.testing.assert_close(y.cpu(), expected)


def test_rms_norm_keeps_leading_dims_and_matches_the_engine_norm():
    from minillm.model.llama import RMSNorm

    norm = RMSNorm(48, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.normal_()
        x = torch.randn(2, 3, 5, 48, device=DEVICE)
        torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x), atol=1e-6, rtol=1e-5)


def test_fused_residual_equals_the_unfused_add_then_norm():
    x, residual = torch.randn(2, 4, 64, device=DEVICE).unbind(0)
    weight = torch.randn(64, device=DEVICE)
    y, h = rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(h, x + residual)
    torch.testing.assert_close(y, rms_norm(x + residual, weight, 1e-6), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x, w, r: (x.to(torch.int32), w, r), "x must be float16 or bfloat16 or float32"),
        (lambda x, w, r: (x, w[:-1], r), r"weight must have shape \[16\]"),
        (lambda x, w, r: (x, w.half(), r), "weight must be float32"),
        (lambda x, w, r: (x.t(), w, r), "x must be contiguous"),
        (lambda x, w, r: (x, w, r[:, :8]), r"residual must have shape \[16, 16\]"),
        (lambda x, w, r: (x, w, r.t()), "residual must be contiguous"),
        (lambda x, w, r: (x, w.to("meta"), r), "weight must be on"),
    ],
)
def test_bad_input_is_rejected_before_launch(change, message):
    x, w, r = torch.randn(16, 16), torch.randn(16), torch.randn(16, 16)
    x, w, r = change(x.to(DEVICE), w.to(DEVICE), r.to(DEVICE))
    with pytest.raises(ValueError, match=message):
        rms_norm(x, w, 1e-6, r)


def test_a_row_longer_than_one_program_holds_is_rejected():
    from kernels.rmsnorm import MAX_HIDDEN_SIZE

    x = torch.empty(1, MAX_HIDDEN_SIZE + 1, device=DEVICE)
    with pytest.raises(ValueError, match=r"0 < hidden_size <= 32768, got \(1, 32769\)"):
        rms_norm(x, torch.empty(MAX_HIDDEN_SIZE + 1, device=DEVICE), 1e-6)


def test_cost_model():
    # 4 rows of 1024 float16: x in, y out, weight once = (2 * 4096 + 1024) * 2 bytes
    assert rms_norm_bytes(4, 1024, 2, residual=False) == (2 * 4096 + 1024) * 2
    assert rms_norm_bytes(4, 1024, 2, residual=True) == (4 * 4096 + 1024) * 2
    assert rms_norm_flops(4, 1024, residual=True) == 5 * 4096


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [4096, 8192, 32768])
def test_rms_norm_at_real_sizes(dtype, hidden_size):
    x, residual = torch.randn(2, 8192, hidden_size, device="cuda", dtype=dtype).unbind(0)
    weight = torch.randn(hidden_size, device="cuda", dtype=dtype)
    y, h = rms_norm(x, weight, 1e-5, residual)
    y_ref, h_ref = rms_norm_reference(x, weight, 1e-5, residual)
    assert_close(h, h_ref, TOLERANCE[dtype])
    assert_close(y, y_ref, TOLERANCE[dtype])
