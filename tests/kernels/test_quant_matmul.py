"""kernels.quant_matmul: quantize/pack properties, and the kernels against dequantize-then-
matmul in float64."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES

from kernels.quant_matmul import (
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
    group_size=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_w4a16_matches_reference(m, n, num_groups, group_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = num_groups * group_size
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, dtype)
    packed, scales = quantize_w4(weight, group_size)
    out = w4a16_matmul(x, packed, scales, group_size)
    assert_matmul_close(out, w4a16_matmul_reference(x, packed, scales, group_size), dtype)


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
    # bfloat16 activations: by default the output is rounded to bfloat16 (23.375); with
    # out_dtype=float32 it is the float32 accumulator itself
    x16 = x.to(torch.bfloat16)
    s16 = scales.to(DEVICE, torch.bfloat16)  # 0.2 rounds to 0.2002 in bfloat16
    assert float(w4a16_matmul(x16, packed.to(DEVICE), s16, 32)) == 23.375
    exact = w4a16_matmul(x16, packed.to(DEVICE), s16, 32, out_dtype=torch.float32)
    assert exact.dtype == torch.float32
    torch.testing.assert_close(exact.cpu(), 117 * s16.float().cpu(), atol=1e-5, rtol=0)


def quantized(kind):
    x, weight = torch.randn(4, 64), torch.randn(16, 64)
    if kind == "w8":
        qweight, scales = quantize_w8(weight)
        return w8a16_matmul, dict(x=x, qweight=qweight, scales=scales)
    packed, scales = quantize_w4(weight, 32)
    return w4a16_matmul, dict(x=x, packed=packed, scales=scales, group_size=32, out_dtype=None)


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
        (
            "w4",
            "out_dtype",
            lambda d: torch.float16,
            "out_dtype must be x's dtype or torch.float32",
        ),
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
