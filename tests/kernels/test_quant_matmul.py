"""kernels.quant_matmul: quantize/pack properties, the magic-number dequantization, and the
kernels against dequantize-then-matmul in float64."""

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES

from kernels.quant_matmul import (
    _dequantize_int4_tile,
    _int4_to_float,
    dequantize_w4,
    dequantize_w8,
    pack_int4,
    plan_quant_matmul,
    quant_matmul_bytes,
    quant_matmul_flops,
    quantize_w4,
    quantize_w8,
    unpack_int4,
    w4a16_matmul,
    w4a16_matmul_reference,
    w8a16_matmul,
    w8a16_matmul_reference,
)

# relative to the largest |y|: the kernels accumulate in float32 in another order and round
# once to the output dtype
MATMUL_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_matmul_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
    tol = MATMUL_TOLERANCE[dtype]
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol * scale, rtol=tol)


@given(
    m=st.integers(0, 20),
    n=st.integers(1, 70),
    k=st.integers(1, 150),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_w8a16_matches_reference(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, dtype)
    qweight, scales = quantize_w8(weight)
    out = w8a16_matmul(x, qweight, scales)
    assert_matmul_close(out, w8a16_matmul_reference(x, qweight, scales), dtype)


@given(
    m=st.integers(0, 20),
    n=st.integers(1, 70),
    num_groups=st.integers(1, 3),
    group_size=st.sampled_from([32, 64, 128, 256]),
    dtype=st.sampled_from(DTYPES),
    asymmetric=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_w4a16_matches_reference(m, n, num_groups, group_size, dtype, asymmetric, seed):
    """m <= 4 runs the GEMV, larger m the tensor-core kernel; asymmetric: every group has
    its own zero point in [0, 15] (all of them, 0 and 15 included, drawn)."""
    gen = torch.Generator().manual_seed(seed)
    k = num_groups * group_size
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, dtype)
    packed, scales = quantize_w4(weight, group_size)
    zeros = None
    if asymmetric:
        zeros = torch.randint(0, 16, (num_groups, n), generator=gen, dtype=torch.uint8)
        zeros = zeros.to(DEVICE)
    out = w4a16_matmul(x, packed, scales, group_size, zeros)
    assert_matmul_close(out, w4a16_matmul_reference(x, packed, scales, group_size, zeros), dtype)


MAGIC = {torch.float16: (0x6400, 1024.0), torch.float32: (0x4B000000, 2.0**23)}


@pytest.mark.parametrize("dtype", list(MAGIC))
def test_the_magic_number_identity_for_every_nibble(dtype):
    """The bits of MAGIC OR u are the float MAGIC + u, for all 16 nibbles u: the constant's
    mantissa bits that u fills are zero, and its unit in the last place is 1."""
    bits, value = MAGIC[dtype]
    assert (
        torch.tensor([bits], dtype=torch.int32)
        .to(torch.int16 if dtype != torch.float32 else torch.int32)
        .view(dtype)
        .item()
        == value
    )
    u = torch.arange(16, dtype=torch.int32)
    int_type = torch.int32 if dtype == torch.float32 else torch.int16
    floats = (u | bits).to(int_type).view(dtype)
    assert floats.tolist() == [value + i for i in range(16)]
    # and minus MAGIC + z, exactly u - z, for every pair
    z = torch.arange(16, dtype=torch.int32)[:, None]
    diff = floats[None, :] - (z | bits).to(int_type).view(dtype)
    assert torch.equal(diff.double(), (u[None, :] - z).double())


@triton.jit
def _magic_kernel(nibbles_ptr, out_ptr, DTYPE: tl.constexpr):
    i = tl.arange(0, 16)
    tl.store(out_ptr + i, _int4_to_float(tl.load(nibbles_ptr + i), DTYPE))


@triton.jit
def _dequantize_tile_kernel(packed_ptr, zeros_ptr, out_ptr, DTYPE: tl.constexpr):
    rows, pairs = tl.arange(0, 16), tl.arange(0, 8)
    packed = tl.load(packed_ptr + rows[:, None] * 8 + pairs[None, :])
    w = _dequantize_int4_tile(packed, tl.load(zeros_ptr + rows), DTYPE)
    tl.store(out_ptr + rows[:, None] * 16 + tl.arange(0, 16)[None, :], w)


TL_DTYPES = {torch.float16: tl.float16, torch.float32: tl.float32}


@pytest.mark.parametrize("dtype", list(TL_DTYPES))
def test_the_kernels_dequantization_is_exact_for_every_nibble_and_zero_point(dtype):
    """The Triton helpers themselves: MAGIC + u for all 16 nibbles, and q - z in k order for
    every (code, zero point) pair, in each dtype the kernels dequantize to (bfloat16
    activations take float32's)."""
    nibbles = torch.arange(16, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(16, dtype=dtype, device=DEVICE)
    _magic_kernel[(1,)](nibbles, out, TL_DTYPES[dtype])
    assert out.cpu().double().tolist() == [MAGIC[dtype][1] + u for u in range(16)]
    # row r has zero point r; its 16 codes are 0..15 in k order (8 bytes)
    codes = torch.arange(16, dtype=torch.int8).repeat(16, 1) - 8
    packed = pack_int4(codes).to(DEVICE)
    zeros = torch.arange(16, dtype=torch.uint8, device=DEVICE)
    w = torch.empty(16, 16, dtype=dtype, device=DEVICE)
    _dequantize_tile_kernel[(1,)](packed, zeros, w, TL_DTYPES[dtype])
    expected = torch.arange(16.0)[None, :] - torch.arange(16.0)[:, None]  # q - z
    assert torch.equal(w.cpu().double(), expected.double())


def test_asymmetric_w4a16_worked_example():
    # one group of 32 codes u = 5 and a zero point 3: W = 0.25 * (5 - 3) = 0.5 everywhere
    packed = pack_int4(torch.full((1, 32), 5 - 8, dtype=torch.int8)).to(DEVICE)
    scales = torch.tensor([[0.25]], device=DEVICE)
    zeros = torch.tensor([[3]], dtype=torch.uint8, device=DEVICE)
    x = torch.arange(32.0, device=DEVICE)[None, :]
    # y = 0.5 * (0 + 1 + ... + 31) = 248; the symmetric grid (z = 8) gives 0.25 * -3 * 496
    assert float(w4a16_matmul(x, packed, scales, 32, zeros)) == 248.0
    assert float(w4a16_matmul(x, packed, scales, 32)) == -372.0
    # through the tensor-core kernel too (m = 8 > GEMV_MAX_M)
    x8 = x.repeat(8, 1)
    assert w4a16_matmul(x8, packed, scales, 32, zeros).flatten().tolist() == [248.0] * 8


@given(q=st.lists(st.integers(-8, 7), min_size=2, max_size=40).filter(lambda v: len(v) % 2 == 0))
def test_pack_then_unpack_is_the_identity(q):
    q = torch.tensor([q], dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_pack_int4_byte_layout():
    # q = [-8, 7, 0, 1]: low nibble of byte 0 is -8 + 8 = 0, high nibble 7 + 8 = 15
    packed = pack_int4(torch.tensor([[-8, 7, 0, 1]], dtype=torch.int8))
    assert packed.tolist() == [[0xF0, 0x98]]
    with pytest.raises(ValueError, match="int4 values must lie in"):
        pack_int4(torch.tensor([[8, 0]], dtype=torch.int8))


@settings(max_examples=10)
@given(n=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_quantization_error_is_at_most_half_a_step(n, seed):
    weight = torch.randn(n, 256, generator=torch.Generator().manual_seed(seed))
    weight[0, :128] = 0  # an all-zero group (and, with n = 1, no all-zero row)
    qweight, scales = quantize_w8(weight)
    assert qweight.abs().max() == 127  # the row's largest weight uses the whole range
    step = scales[:, None]
    assert ((dequantize_w8(qweight, scales) - weight).abs() <= step / 2 * (1 + 1e-6)).all()
    packed, scales = quantize_w4(weight, 128)
    assert scales.shape == (2, n)  # [K / group_size, N]: group-major
    step = scales.T.repeat_interleave(128, dim=1)
    assert ((dequantize_w4(packed, scales, 128) - weight).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(dequantize_w4(packed, scales, 128)[0, :128], torch.zeros(128))


@pytest.mark.parametrize("m", [2, 8])  # the W4A16 GEMV (m <= 4) and tensor-core kernels
def test_split_k_sums_to_the_unsplit_result(monkeypatch, m):
    from kernels import quant_matmul

    monkeypatch.setattr(quant_matmul, "MIN_K_STEPS_PER_SPLIT", 1)  # split on a GPU too
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=gen).to(DEVICE)
    packed, scales = quantize_w4(torch.randn(24, 512, generator=gen) * 0.05, 64)
    qweight, scales8 = quantize_w8(torch.randn(24, 512, generator=gen) * 0.05)
    packed, scales, qweight, scales8 = (t.to(DEVICE) for t in (packed, scales, qweight, scales8))
    device = torch.device(DEVICE)
    # one output tile, few SMs' worth of programs: K is split ...
    plans = [
        plan_quant_matmul(m, 24, 512, 4, 4, 64, device),
        plan_quant_matmul(m, 24, 512, 4, 8, None, device),
    ]
    assert plans[0].kernel == ("w4a16_gemv" if m <= 4 else "w4a16")
    assert all(plan.split_k > 1 for plan in plans), plans
    split4, split8 = w4a16_matmul(x, packed, scales, 64), w8a16_matmul(x, qweight, scales8)
    monkeypatch.setattr(quant_matmul, "MAX_SPLIT_K", 1)  # ... or not
    assert plan_quant_matmul(m, 24, 512, 4, 4, 64, device).split_k == 1
    torch.testing.assert_close(split4, w4a16_matmul(x, packed, scales, 64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split8, w8a16_matmul(x, qweight, scales8), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split4, w4a16_matmul_reference(x, packed, scales, 64))


def test_plan_picks_the_gemv_for_a_few_rows():
    cpu = torch.device("cpu")
    for m, kernel, block_m in [(1, "w4a16_gemv", 1), (3, "w4a16_gemv", 4), (4, "w4a16_gemv", 4)]:
        plan = plan_quant_matmul(m, 4096, 4096, 2, 4, 128, cpu)
        assert (plan.kernel, plan.block_m) == (kernel, block_m)
    assert plan_quant_matmul(5, 4096, 4096, 2, 4, 128, cpu).kernel == "w4a16"
    # W8A16 has no GEMV path
    assert plan_quant_matmul(1, 4096, 4096, 2, 8, None, cpu).kernel == "w8a16"


def test_choose_split_k():
    from kernels.quant_matmul import MAX_SPLIT_K, MIN_K_STEPS_PER_SPLIT, choose_split_k

    # batch 1, N = 4096 in 32-column tiles: 128 tiles on 132 SMs want 3 splits
    assert choose_split_k(128, 32 * MIN_K_STEPS_PER_SPLIT, 132) == 3
    # enough output tiles: no split; few K steps: few splits
    assert choose_split_k(4096, 32, 132) == 1
    assert choose_split_k(1, 2 * MIN_K_STEPS_PER_SPLIT, 132) == 2
    assert choose_split_k(1, 10**6, 132) == MAX_SPLIT_K


def test_w4a16_worked_example():
    # one group of 32 weights, all 0.7 except w[0, 1] = -1.4: scale 0.2, q = 3.5 -> 4, -7
    weight = torch.full((1, 32), 0.7)
    weight[0, 1] = -1.4
    packed, scales = quantize_w4(weight, 32)
    torch.testing.assert_close(scales, torch.tensor([[0.2]]))
    x = torch.ones(1, 32, device=DEVICE)
    # y = 0.2 * (31 * 4 - 7) = 23.4
    out = w4a16_matmul(x, packed.to(DEVICE), scales.to(DEVICE), 32)
    torch.testing.assert_close(out.cpu(), torch.tensor([[23.4]]))
    # bfloat16 activations: the output is rounded once to bfloat16 (0.2 rounds to 0.2002 in
    # bfloat16, and 117 * 0.2002 = 23.42 to 23.375)
    x16 = x.to(torch.bfloat16)
    s16 = scales.to(DEVICE, torch.bfloat16)
    assert float(w4a16_matmul(x16, packed.to(DEVICE), s16, 32)) == 23.375


def quantized(kind):
    x, weight = torch.randn(4, 64), torch.randn(16, 64)
    if kind == "w8":
        qweight, scales = quantize_w8(weight)
        return w8a16_matmul, dict(x=x, qweight=qweight, scales=scales)
    packed, scales = quantize_w4(weight, 32)
    zeros = torch.zeros(2, 16, dtype=torch.uint8)
    return w4a16_matmul, dict(x=x, packed=packed, scales=scales, group_size=32, zeros=zeros)


@pytest.mark.parametrize(
    ("kind", "name", "change", "message"),
    [
        ("w8", "x", lambda t: t.to(torch.int8), "x must be float16 or bfloat16 or float32"),
        ("w8", "x", lambda t: t[None], r"x must have shape \[M, K\]"),
        ("w8", "qweight", lambda t: t.to(torch.int16), "qweight must be int8"),
        ("w8", "qweight", lambda t: t[:, :32], r"qweight must have shape \[\*, 64\]"),
        ("w8", "scales", lambda t: t.half(), "scales must be float32"),
        ("w8", "scales", lambda t: t[:4], r"scales must have shape \[16\]"),
        ("w8", "qweight", lambda t: t.t().contiguous().t(), "qweight must be contiguous"),
        ("w8", "scales", lambda t: t.to("meta"), "scales must be on"),
        ("w4", "packed", lambda t: t.to(torch.int8), "packed must be uint8"),
        ("w4", "packed", lambda t: t[:, :16], r"packed must have shape \[\*, 32\]"),
        ("w4", "scales", lambda t: t[:1], r"scales must have shape \[2, 16\]"),
        ("w4", "scales", lambda t: t.T.contiguous(), r"scales must have shape \[2, 16\]"),
        ("w4", "group_size", lambda g: 48, "group_size must be 32, 64, 128 or 256"),
        ("w4", "group_size", lambda g: 128, r"x's K \(64\) must be a multiple of group_size"),
        ("w4", "zeros", lambda t: t.to(torch.int8), "zeros must be uint8"),
        ("w4", "zeros", lambda t: t.T.contiguous(), r"zeros must have shape \[2, 16\]"),
        ("w4", "zeros", lambda t: t.to("meta"), "zeros must be on"),
    ],
)
def test_bad_input_is_rejected_before_launch(kind, name, change, message):
    fn, args = quantized(kind)
    args = {
        key: value.to(DEVICE) if torch.is_tensor(value) else value for key, value in args.items()
    }
    args[name] = change(args[name])
    with pytest.raises(ValueError, match=message):
        fn(**args)


def test_cost_model():
    # batch 1, 4096 x 4096, bfloat16 activations: W4 weights are 8 MiB, scales 4096 * 32
    m, n, k = 1, 4096, 4096
    assert quant_matmul_flops(m, n, k) == 2 * 4096 * 4096
    w4 = quant_matmul_bytes(m, n, k, 2, weight_bits=4, group_size=128)
    assert w4 == (4096 + 4096 + 4096 * 32) * 2 + 4096 * 4096 // 2
    w8 = quant_matmul_bytes(m, n, k, 2, weight_bits=8, group_size=None)
    assert w8 == (4096 + 4096 + 4096) * 2 + 4096 * 4096


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("m", [1, 16, 333, 2048])
def test_quant_matmul_at_real_sizes(dtype, m):
    x = torch.randn(m, 4096, device="cuda", dtype=dtype)
    weight = torch.randn(11008, 4096, device="cuda", dtype=dtype) * 0.02
    qweight, scales = quantize_w8(weight)
    out = w8a16_matmul(x, qweight, scales)
    assert_matmul_close(out, w8a16_matmul_reference(x, qweight, scales), dtype)
    packed, scales = quantize_w4(weight)
    out = w4a16_matmul(x, packed, scales)
    assert_matmul_close(out, w4a16_matmul_reference(x, packed, scales, 128), dtype)
    zeros = torch.randint(0, 16, scales.shape, device="cuda", dtype=torch.uint8)
    out = w4a16_matmul(x, packed, scales, 128, zeros)
    assert_matmul_close(out, w4a16_matmul_reference(x, packed, scales, 128, zeros), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (3, 4096, 14336), (16, 4096, 4096)])
def test_split_k_at_decode_sizes(m, n, k, group_size):
    """Decode-sized M on a real GPU: the plans split K (the GEMV at m <= 4), and the fused
    sum of the partial results matches the oracle."""
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.02
    plan4 = plan_quant_matmul(m, n, k, 2, 4, group_size, x.device)
    plan8 = plan_quant_matmul(m, n, k, 2, 8, None, x.device)
    assert plan4.kernel == ("w4a16_gemv" if m <= 4 else "w4a16")
    assert plan4.split_k > 1 and plan8.split_k > 1, (plan4, plan8)
    packed, scales = quantize_w4(weight, group_size)
    out = w4a16_matmul(x, packed, scales, group_size)
    assert_matmul_close(out, w4a16_matmul_reference(x, packed, scales, group_size), dtype)
    qweight, scales8 = quantize_w8(weight)
    assert_matmul_close(
        w8a16_matmul(x, qweight, scales8), w8a16_matmul_reference(x, qweight, scales8), dtype
    )
