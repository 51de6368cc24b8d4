"""Quantized linear layers against one oracle: the float weight the test builds from the
codes, scales and zeros, then x @ w.T in float64. The PyTorch path and the Triton path (under
the interpreter on a CPU, in float32 and float16: its bfloat16 dot is wrong there) are held to
it alike."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_testing import reference_linear

from kernels import INTERPRETED
from minillm.model.quantization.linear import (
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    weight_bytes,
)

DEVICE = "cpu" if INTERPRETED else "cuda"
# relative to the largest |y|: the float16 paths round the weight or the output to float16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}


def assert_matches(y: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == expected.shape
    tol = TOLERANCE[dtype] * max(1.0, float(expected.abs().max()) if expected.numel() else 1.0)
    torch.testing.assert_close(y.double().cpu(), expected.cpu(), atol=tol, rtol=TOLERANCE[dtype])


def int4_case(gen, n, k, group_size, symmetric, permuted):
    """Random codes, scales, zeros (and permutation); the oracle's weight built by loops."""
    groups = k // group_size
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half().float()
    zeros = None if symmetric else torch.randint(0, 16, (n, groups), generator=gen)
    perm = torch.randperm(k, generator=gen) if permuted else None
    weight = torch.empty(n, k, dtype=torch.float64)
    for j in range(k):  # stored column j: input channel perm[j], group j // group_size
        channel = j if perm is None else int(perm[j])
        z = 8 if zeros is None else zeros[:, j // group_size].double()
        weight[:, channel] = scales[:, j // group_size].double() * (codes[:, j].double() - z)
    return codes, scales, zeros, perm, weight


@given(
    m=st.integers(0, 5),
    n=st.integers(1, 24),
    num_groups=st.integers(1, 2),
    group_size=st.sampled_from([32, 64]),
    symmetric=st.booleans(),
    permuted=st.booleans(),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_int4_torch_path_matches_the_oracle(
    m, n, num_groups, group_size, symmetric, permuted, bias, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    k = num_groups * group_size
    codes, scales, zeros, perm, weight = int4_case(gen, n, k, group_size, symmetric, permuted)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    layer = Int4Linear(codes, scales, zeros, group_size, b, dtype, perm)
    torch.testing.assert_close(layer.dequantize().double(), weight, atol=0, rtol=0)
    x = torch.randn(2, m, k, generator=gen).to(dtype)
    assert_matches(layer(x), reference_linear(x, weight, b), dtype)
    assert torch.equal(layer.codes(), codes) and not torch.is_floating_point(layer.packed)


@settings(max_examples=8)
@given(
    m=st.integers(1, 4),
    n=st.integers(1, 40),
    num_groups=st.integers(1, 2),
    symmetric=st.booleans(),
    permuted=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_int4_triton_path_matches_the_same_oracle(
    m, n, num_groups, symmetric, permuted, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    k = num_groups * 32
    codes, scales, zeros, perm, weight = int4_case(gen, n, k, 32, symmetric, permuted)
    layer = Int4Linear(codes, scales, zeros, 32, None, dtype, perm).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    assert layer.has_kernel
    assert_matches(layer.forward_kernel(x), reference_linear(x.cpu(), weight), dtype)


def test_int4_kernel_rounds_once_with_zero_points_in_bfloat16():
    """The kernel subtracts the zero points from the codes before any product (exactly) and
    rounds the float32 accumulator once to bfloat16: every output lies within one bfloat16
    unit in the last place of the float64 product with the layer's own (bfloat16) scales
    (the interpreter truncates where a GPU rounds to nearest, so one unit, not half).
    Dequantizing to bfloat16 first, as the PyTorch path does, rounds every weight too, and
    misses that bound."""
    gen = torch.Generator().manual_seed(3)
    codes, scales, zeros, perm, _ = int4_case(gen, 64, 128, 32, False, False)
    layer = Int4Linear(codes, scales, zeros, 32, None, torch.bfloat16, perm).to(DEVICE)
    x = torch.randn(8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    # s (q - z) with s in bfloat16 and |q - z| <= 15 is exact in float32
    weight = layer.scales.T.double().cpu().repeat_interleave(32, dim=1)
    weight = weight * (codes.double() - zeros.double().repeat_interleave(32, dim=1))
    expected = reference_linear(x.cpu(), weight)

    def within_one_ulp(y):
        ulp = torch.finfo(torch.bfloat16).eps * expected.abs()
        return bool(((y.double().cpu() - expected).abs() <= ulp + 1e-6).all())

    assert within_one_ulp(layer.forward_kernel(x))
    assert not within_one_ulp(layer.forward_torch(x))


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_forward_kernel_is_one_kernel_call(monkeypatch, symmetric):
    """Zero points are prepared once, at load ([G, N] uint8, the kernel's layout), and applied
    inside the kernel: the layer's output is the kernel's, with nothing computed around it."""
    from minillm.model.quantization import linear

    gen = torch.Generator().manual_seed(5)
    codes, scales, zeros, perm, weight = int4_case(gen, 16, 64, 32, symmetric, False)
    layer = Int4Linear(codes, scales, zeros, 32, None, torch.float32, perm).to(DEVICE)
    assert (layer.zero_points is None) == symmetric
    if not symmetric:
        assert layer.zero_points.dtype == torch.uint8 and layer.zero_points.shape == (2, 16)
    calls = []
    kernel = linear.w4a16_matmul

    def recording(*args):
        calls.append(args)
        calls.append(kernel(*args))
        return calls[-1]

    monkeypatch.setattr(linear, "w4a16_matmul", recording)
    x = torch.randn(3, 64, generator=gen).to(DEVICE)
    y = layer.forward_kernel(x)
    assert len(calls) == 2 and y is calls[1]
    assert calls[0][4] is layer.zero_points
    assert_matches(y, reference_linear(x.cpu(), weight), torch.float32)


@given(
    m=st.integers(0, 5),
    n=st.integers(1, 24),
    k=st.integers(1, 80),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_int8_torch_path_matches_the_oracle(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=gen)
    scales = (torch.rand(n, generator=gen) * 0.01 + 1e-4).to(dtype)
    weight = codes.double() * scales.double()[:, None]
    layer = Int8Linear(codes, scales, None, dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    assert_matches(layer(x), reference_linear(x, weight), dtype)


@settings(max_examples=8)
@given(
    m=st.integers(1, 4),
    n=st.integers(1, 40),
    k=st.integers(1, 90),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_int8_triton_path_matches_the_same_oracle(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=gen)
    scales = (torch.rand(n, generator=gen) * 0.01 + 1e-4).to(dtype)
    weight = codes.double() * scales.double()[:, None]
    layer = Int8Linear(codes, scales, None, dtype).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    assert_matches(layer.forward_kernel(x), reference_linear(x.cpu(), weight), dtype)


@given(n=st.integers(1, 16), k=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_fp8_matches_the_oracle_and_its_error_bound(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    layer = Fp8Linear(w, None)
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 448.0
    codes = (w / scales[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(layer.weight_bits, codes.view(torch.uint8))
    weight = codes.double() * scales.double()[:, None]
    torch.testing.assert_close(layer.dequantize().double(), weight, atol=0, rtol=2**-23)
    # E4M3's unit roundoff 2^-4 in the normal range; below 2^-6 the absolute spacing 2^-9
    bound = w.abs().double() * 2.0**-4 + scales.double()[:, None] * 2.0**-10
    assert ((weight - w.double()).abs() <= bound * (1 + 1e-6)).all()
    x = torch.randn(3, k, generator=gen)
    assert_matches(layer(x), reference_linear(x, weight), torch.float32)
    assert layer.weight_bits.dtype == torch.uint8 and layer.weight_bytes() == n * k + 4 * n


def test_weight_bytes_count_every_stored_tensor():
    n, k, g = 8, 128, 32
    codes = torch.randint(0, 16, (n, k))
    scales = torch.rand(n, k // g) + 0.1
    zeros = torch.randint(0, 16, (n, k // g))
    bias = torch.zeros(n)
    layer = Int4Linear(codes, scales, zeros, g, bias, torch.float16)
    # packed nibbles + float16 scales + int8 zero points + float16 bias
    assert layer.weight_bytes() == n * k // 2 + 2 * n * (k // g) + n * (k // g) + 2 * n
    symmetric = Int4Linear(codes, scales, None, g, None, torch.float32, torch.randperm(k))
    assert symmetric.weight_bytes() == n * k // 2 + 4 * n * (k // g) + 8 * k
    int8 = Int8Linear(torch.zeros(n, k, dtype=torch.int8), torch.ones(n), None, torch.bfloat16)
    assert int8.weight_bytes() == n * k + 2 * n

    model = torch.nn.Sequential(torch.nn.Embedding(10, k), layer)
    assert weight_bytes(model) == 10 * k * 4 + layer.weight_bytes()
    assert layer.state_dict() == {}  # the checkpoint formats write these, not state_dict()


def test_bad_layers_are_refused():
    with pytest.raises(ValueError, match="int4 codes"):
        Int4Linear(torch.full((2, 64), 16), torch.ones(2, 2), None, 32, None, torch.float32)
    with pytest.raises(ValueError, match="zero points"):
        Int4Linear(
            torch.zeros(2, 64), torch.ones(2, 2), torch.full((2, 2), -1), 32, None, torch.float32
        )
    with pytest.raises(ValueError, match="divide"):
        Int4Linear(torch.zeros(2, 48), torch.ones(2, 1), None, 32, None, torch.float32)
    with pytest.raises(ValueError, match="permutation"):
        Int4Linear(
            torch.zeros(2, 64),
            torch.ones(2, 2),
            None,
            32,
            None,
            torch.float32,
            torch.zeros(64, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="int8 codes"):
        Int8Linear(torch.full((2, 4), 128), torch.ones(2), None, torch.float32)
    assert issubclass(Fp8Linear, QuantizedLinear)


def test_group_sizes_without_a_kernel_use_the_dequantize_path():
    layer = Int4Linear(
        torch.zeros(2, 48, dtype=torch.int32), torch.ones(2, 1), None, 48, None, torch.float32
    )
    assert not layer.has_kernel
    assert torch.equal(layer(torch.ones(1, 48)), torch.full((1, 2), -8.0 * 48))
