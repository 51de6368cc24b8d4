"""minillm.lab.numerics against values derived independently: torch.finfo and torch's own
float8/float16/bfloat16 conversions, every bit pattern decoded by PyTorch, the OCP
Microscaling spec's constants, hand-counted parameters, and brute-force scans."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab import numerics as nm
from minillm.lab.catalog import get_model_config
from minillm.lab.hardware import get_device

TORCH_FORMATS = [
    (nm.FLOAT32, torch.float32),
    (nm.BFLOAT16, torch.bfloat16),
    (nm.FLOAT16, torch.float16),
    (nm.FP8_E4M3, torch.float8_e4m3fn),
    (nm.FP8_E5M2, torch.float8_e5m2),
]


def torch_values(dtype: torch.dtype) -> list[float]:
    """Every finite value of a 8- or 16-bit torch dtype, by viewing every bit pattern."""
    bits = torch.finfo(dtype).bits
    codes = torch.arange(2**bits, dtype=torch.int32)
    raw = codes.to(torch.uint8) if bits == 8 else (codes - 2**16 * (codes >= 2**15)).to(torch.int16)
    v = raw.view(dtype).double()
    return sorted({x + 0.0 for x in v.tolist() if math.isfinite(x)})


@pytest.mark.parametrize("fmt, dtype", TORCH_FORMATS, ids=lambda f: getattr(f, "name", str(f)))
def test_layout_constants_match_torch_finfo(fmt, dtype):
    row = nm.format_row(fmt)
    info = torch.finfo(dtype)
    assert row["bits"] == info.bits
    assert row["max"] == info.max
    assert row["min_normal"] == info.smallest_normal
    assert row["gap_above_1"] == info.eps
    assert row["unit_roundoff"] == info.eps / 2


def test_e4m3fn_has_no_infinity_and_tops_out_at_448():
    row = nm.format_row(nm.FP8_E4M3)
    assert row["max"] == 448 and not row["infinities"] and row["nan"]
    assert nm.format_row(nm.FP8_E5M2)["max"] == 57344 and nm.format_row(nm.FP8_E5M2)["infinities"]


@pytest.mark.parametrize("fmt, dtype", TORCH_FORMATS[1:], ids=lambda f: getattr(f, "name", str(f)))
def test_enumerated_values_match_every_torch_bit_pattern(fmt, dtype):
    values, _ = nm.rounding_table(fmt)
    assert values.tolist() == torch_values(dtype)
    assert fmt.min_subnormal == min(v for v in torch_values(dtype) if v > 0)


@pytest.mark.parametrize("fmt, dtype", TORCH_FORMATS[1:], ids=lambda f: getattr(f, "name", str(f)))
def test_spacing_near_one_from_neighbours_of_one(fmt, dtype):
    values = torch_values(dtype)
    i = values.index(1.0)
    assert nm.spacing_near_one(fmt) == (1.0 - values[i - 1], values[i + 1] - 1.0)


@pytest.mark.parametrize("fmt, dtype", TORCH_FORMATS[1:], ids=lambda f: getattr(f, "name", str(f)))
@given(st.lists(st.floats(-1e5, 1e5, allow_nan=False), min_size=1, max_size=64))
def test_round_to_format_matches_torch_conversion(fmt, dtype, xs):
    x = torch.tensor(xs, dtype=torch.float64).clamp(-fmt.max, fmt.max)
    got = nm.round_to_format(x, fmt)
    assert torch.equal(got, x.to(dtype).double())


def test_fp4_e2m1_values_and_ties_from_the_ocp_mx_spec():
    # OCP Microscaling Formats v1.0, table of FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives
    values, _ = nm.rounding_table(nm.FP4_E2M1)
    positive = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert values.tolist() == sorted({-v + 0.0 for v in positive} | set(positive))
    got = nm.round_to_format(
        torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.0]), nm.FP4_E2M1
    )
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0]  # ties to even codes


def test_block_formats_bits_and_scale_range():
    assert nm.MXFP4.block_size == 32 and nm.MXFP4.bits_per_element == 4 + 8 / 32
    assert nm.NVFP4.block_size == 16 and nm.NVFP4.bits_per_element == 4 + 8 / 16
    assert nm.MXFP4.scale_range == (2.0**-127, 2.0**127)  # E8M0: 2^-127 .. 2^127
    assert nm.NVFP4.scale_range == (2.0**-9, 448.0)
    assert nm.NVFP4.max_in_block_units == 6 * 448


def test_mxfp4_shared_exponent_follows_the_spec():
    # X = 2^(floor(log2 amax) - 2): amax 6 -> X = 1, amax 12 -> X = 2, amax 7 -> X = 1, 7 clips
    block = torch.tensor([6.0, 0.5, -3.0] + [0.0] * 29)
    assert torch.equal(nm.block_quantize(block, nm.MXFP4), block)
    assert torch.equal(nm.block_quantize(block * 2, nm.MXFP4), block * 2)
    clipped = nm.block_quantize(torch.tensor([7.0] + [1.0] * 31), nm.MXFP4)
    assert clipped[0] == 6.0 and torch.all(clipped[1:] == 1.0)


def nearest_fp4(v: float) -> float:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    even = [True, False, True, False, True, False, True, False]
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(grid[i] - a), not even[i]))
    return math.copysign(grid[best], v)


@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=32, max_size=32))
def test_nvfp4_matches_a_loop_with_torch_fp8_scales(xs):
    x = torch.tensor(xs)
    tensor_amax = max(abs(v) for v in xs)
    tensor_scale = tensor_amax / (6 * 448) if tensor_amax else 1.0
    expected = []
    for b in range(2):
        block = xs[16 * b : 16 * b + 16]
        raw = max(abs(v) for v in block) / 6 / tensor_scale
        s = float(torch.tensor(raw).to(torch.float8_e4m3fn).float())
        s = s if s > 0 else 1.0
        expected += [nearest_fp4(v / (s * tensor_scale)) * s * tensor_scale for v in block]
    torch.testing.assert_close(nm.block_quantize(x, nm.NVFP4), torch.tensor(expected))


@given(st.integers(1, 6), st.sampled_from([8, 4]))
def test_fake_quantize_error_bounds_and_granularities(seed, bits):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))
    q_max = 2 ** (bits - 1) - 1
    per_tensor = nm.fake_quantize(w, bits, "tensor")
    assert (per_tensor - w).abs().max() <= w.abs().max() / q_max / 2 * (1 + 1e-6)
    assert len(torch.unique(per_tensor)) <= 2 * q_max + 1
    per_row = nm.fake_quantize(w, bits, "channel")
    assert torch.equal(per_row, nm.fake_quantize(w, bits, "group", group_size=64))
    bound = w.abs().amax(dim=1, keepdim=True) / q_max / 2
    assert torch.all((per_row - w).abs() <= bound * (1 + 1e-6))
    groups = nm.fake_quantize(w, bits, "group", group_size=16)
    assert nm.relative_error(groups, w) <= nm.relative_error(per_row, w) + 1e-6


def test_outliers_break_per_tensor_scales():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    before = nm.relative_error(nm.fake_quantize(w, 8, "tensor"), w)
    w[5, 7] = 100 * w.abs().max()
    assert nm.outlier_ratio(w) > 100
    after = nm.relative_error(nm.fake_quantize(w, 8, "tensor"), w)
    assert after > 5 * before
    assert nm.relative_error(nm.fake_quantize(w, 8, "channel"), w) < after / 5


def llama70b_linear_params() -> int:
    # Llama 3.3 70B's config.json: hidden 8192, 64 heads and 8 KV heads of 128, MLP 28672
    h, q, kv, inter = 8192, 64 * 128, 8 * 128, 28672
    return 80 * (h * q + 2 * h * kv + q * h + 3 * h * inter)


def test_quantized_70b_bytes_by_hand():
    config = get_model_config("Llama 3.3 70B")
    linear = llama70b_linear_params()
    got = nm.quantized_model_bytes(config, 4, 128, scale_bytes=2, zero_bytes=0.5)
    assert got.codes == linear / 2
    assert got.scales == linear / 128 * 2 and got.zeros == linear / 128 * 0.5
    # the rest: two 128256 x 8192 tables (untied), 161 RMSNorms of 8192, in bf16
    assert got.unquantized == (2 * 128256 * 8192 + 161 * 8192) * 2
    per_channel = nm.quantized_model_bytes(config, 8, None, scale_bytes=2)
    assert per_channel.scales == 80 * (8192 + 1024 + 1024 + 8192 + 28672 * 2 + 8192) * 2


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_bytes_match_the_engine(quantization):
    from minillm.model.loader import DEFAULT_MODEL, load_model
    from minillm.model.quantization import quantize_model, weight_bytes

    loaded = load_model(DEFAULT_MODEL, dtype="float32")
    quantize_model(loaded.model, quantization, 128, "rtn", None)
    if quantization == "int4":  # float32 scales, int8 zero points, in this engine's layout
        expected = nm.quantized_model_bytes(loaded.config, 4, 128, 4, 1, 4)
    else:  # int8 or fp8 codes, one float32 scale per output channel
        expected = nm.quantized_model_bytes(loaded.config, 8, None, 4, 0, 4)
    assert weight_bytes(loaded.model) == expected.total


@pytest.mark.parametrize("device", ["H100 SXM", "A100 SXM 80GB", "L4"])
def test_w4a16_batches_by_scanning_the_floors(device):
    spec = get_device(device)
    n, k = 14336, 4096
    b4, b16 = nm.w4a16_batches(n, k, spec)
    compute = lambda m: 2 * m * n * k / spec.peak_flops("bfloat16")  # noqa: E731
    scan4 = next(
        m for m in range(1, 10**5) if nm.linear_floor_s(m, n, k, spec, "w4a16") == compute(m)
    )
    scan16 = next(m for m in range(1, 10**5) if nm.linear_floor_s(m, n, k, spec) == compute(m))
    assert (b4, b16) == (scan4, scan16)
    assert b4 < b16
    gain = lambda m: nm.linear_floor_s(m, n, k, spec) / nm.linear_floor_s(m, n, k, spec, "w4a16")  # noqa: E731
    assert 3.5 < gain(1) < 4 and gain(b16) == 1.0 and gain(b4) > gain(b16)
    assert nm.linear_floor_s(4 * b16, n, k, spec, "w8a8") < nm.linear_floor_s(4 * b16, n, k, spec)


def test_smoothquant_balances_and_preserves_the_layer():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    x[:, 3] *= 50  # an outlier channel, as LLM activations have
    w = torch.randn(16, 64, generator=g)
    s = nm.smoothquant_scales(x.abs().amax(0), w.abs().amax(0), 0.5)
    torch.testing.assert_close((x / s).abs().amax(0), (w * s).abs().amax(0))
    torch.testing.assert_close((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-3)
    assert torch.equal(
        nm.smoothquant_scales(x.abs().amax(0), w.abs().amax(0), 0.0), 1 / w.abs().amax(0)
    )
    with pytest.raises(ValueError, match="alpha"):
        nm.smoothquant_scales(x.abs().amax(0), w.abs().amax(0), 1.5)


def test_w8a8_error_falls_with_smoothing_on_outlier_channels():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g)
    x[:, [5, 77]] *= 40
    w = torch.randn(32, 128, generator=g)
    s = nm.smoothquant_scales(x.abs().amax(0), w.abs().amax(0), 0.5)
    assert nm.w8a8_output_error(x, w, s) < nm.w8a8_output_error(x, w) / 2


def test_the_engines_w8a8_layer_has_the_fake_quantized_error():
    """The engine's int8 layer (integer matmul, float16-rounded weight scales) and the fake
    quantization (float round trips) are two implementations of one scheme: their errors
    agree to a few percent, with and without smoothing."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=g)
    x[:, [5, 77]] *= 40
    w = torch.randn(32, 128, generator=g) * 0.05
    s = nm.smoothquant_scales(x.abs().amax(0), w.abs().amax(0), 0.5)
    for smooth in (None, s):
        engine, fake = nm.engine_w8a8_error(x, w, smooth), nm.w8a8_output_error(x, w, smooth)
        assert engine == pytest.approx(fake, rel=0.05)
    assert nm.engine_w8a8_error(x, w, s) < nm.engine_w8a8_error(x, w) / 2


def test_row_in_batch_is_exact_alone_and_per_row():
    x = torch.randn(16, 64, dtype=torch.float64)
    w = torch.randn(32, 64, dtype=torch.float64)
    diffs = nm.row_in_batch_differs(x, w, [1, 4, 16])
    assert diffs[1] == 0.0 and all(d < 1e-12 for d in diffs.values())
    with pytest.raises(ValueError, match="batch size"):
        nm.row_in_batch_differs(x, w, [17])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="granularity"):
        nm.fake_quantize(torch.ones(2, 4), 8, "row")
    with pytest.raises(ValueError, match="block size"):
        nm.block_quantize(torch.ones(3, 20), nm.MXFP4)
    with pytest.raises(ValueError, match="no infinity"):
        nm.round_to_format(torch.tensor([500.0]), nm.FP8_E4M3, saturate=False)
    assert nm.round_to_format(torch.tensor([70000.0]), nm.FLOAT16, saturate=False).isinf().all()
    assert nm.round_to_format(torch.tensor([65519.0]), nm.FLOAT16, saturate=False) == 65504
    with pytest.raises(ValueError, match="never becomes compute-bound"):
        nm.w4a16_batches(256, 512, get_device("H100 SXM"))
    with pytest.raises(ValueError, match="scheme"):
        nm.linear_floor_s(1, 8, 8, get_device("H100 SXM"), "w2a2")


def test_linear_inputs_is_what_a_full_forward_feeds_the_layer():
    from minillm.model.loader import load_model

    model = load_model("minillm-stdlib-target", dtype="float32").model
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    down = model.model.layers[2].mlp.down_proj
    seen = []
    hook = down.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].detach()))
    with torch.no_grad():
        model.forward_causal(ids)
    hook.remove()
    got = nm.linear_inputs(model, down, ids)
    assert got.shape == (2, 24, down.in_features)
    torch.testing.assert_close(got, seen[0], rtol=0, atol=0)
    assert not down._forward_pre_hooks  # the hook is gone
    with pytest.raises(ValueError, match="not reached"):
        nm.linear_inputs(model, torch.nn.Linear(2, 2), ids)
