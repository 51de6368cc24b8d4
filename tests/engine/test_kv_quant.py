"""FP8 KV cache: scales, saturation, the paged prefill/decode path and the range rescaling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab import kv_quant
from minillm.model.loader import load_model

ARCHS = ["llama", "qwen2", "qwen3"]


def test_scale_maps_the_largest_value_to_448():
    x = torch.tensor([-3.5, 0.25, 7.0])
    assert kv_quant.fp8_scale(x) == 7.0 / 448
    assert kv_quant.fp8_scale(torch.zeros(4)) == 1.0
    assert kv_quant.FP8_E4M3_MAX == 448.0
    with pytest.raises(ValueError):
        kv_quant.fp8_scale(torch.tensor([1.0, float("inf")]))


def test_scale_one_clips_beyond_448_and_flushes_tiny_values():
    x = torch.tensor([600.0, -1000.0, 448.0, 1.0, 1e-3, 1e-4])
    back = kv_quant.fp8_roundtrip(x, 1.0)
    assert back.tolist()[:4] == [448.0, -448.0, 448.0, 1.0]
    assert back[4] == 2**-9  # subnormal: 0.001 rounds to the smallest step, 0.00195
    assert back[5] == 0.0
    # a calibrated scale keeps all of them within the format's relative precision
    calibrated = kv_quant.fp8_roundtrip(x[:4], kv_quant.fp8_scale(x[:4]))
    assert torch.allclose(calibrated, x[:4], rtol=2**-4)


@given(
    st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=1, max_size=64),
    st.floats(1e-3, 1e3),
)
def test_calibrated_roundtrip_error_is_within_half_a_step(values, magnitude):
    x = torch.tensor(values, dtype=torch.float32) * magnitude
    scale = kv_quant.fp8_scale(x)
    back = kv_quant.fp8_roundtrip(x, scale)
    # 3 mantissa bits: relative error <= 2**-4 for normal codes; the subnormal step is
    # 2**-9 * scale, so small values are off by at most half of that
    bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10 * scale))
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))
    assert kv_quant.quantize_fp8(x, scale).dtype == torch.float8_e4m3fn


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_llama import build_tiny_llama

    return load_model(build_tiny_llama(tmp_path_factory.mktemp("tiny"))).model


def test_decode_logits_match_the_plain_causal_forward(tiny_model):
    tokens = list(range(3, 40))
    for block_size in (4, 16):
        got = kv_quant.decode_logits(tiny_model, tokens, block_size=block_size)
        expected = tiny_model.forward_causal(torch.tensor([tokens]))[0, -1]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_transform_sees_the_prefill_cache(tiny_model):
    seen = []

    def transform(kv_caches):
        seen.append([c.clone() for c in kv_caches])

    kv_quant.decode_logits(tiny_model, list(range(3, 23)), transform, block_size=8)
    [caches] = seen
    assert len(caches) == tiny_model.config.num_hidden_layers
    # 19 prefill tokens written in 3 blocks of 8; the slots after them are still zero
    flat = caches[0].flatten(1, 2)  # [2, slots, heads, dim]
    assert flat[:, :19].abs().sum(dim=(0, 2, 3)).gt(0).all()
    assert flat[:, 19:].abs().sum() == 0


def test_quantizing_the_cache_changes_logits_a_little(hf_checkpoint):
    model = load_model(hf_checkpoint("llama")[0]).model
    tokens = list(range(5, 45))
    exact = kv_quant.decode_logits(model, tokens)
    scales = []
    fp8 = kv_quant.decode_logits(
        model, tokens, lambda c: scales.extend(kv_quant.quantize_kv_caches_(c))
    )
    assert len(scales) == model.config.num_hidden_layers
    assert all(k > 0 and v > 0 for k, v in scales)
    error = (fp8 - exact).abs().max().item()
    assert 0 < error < 0.1 * exact.abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("alpha", [1e-3, 50.0])
def test_scale_kv_range_keeps_the_function_and_scales_the_cache(hf_checkpoint, arch, alpha):
    path, _ = hf_checkpoint(arch)
    model = load_model(path).model
    scaled = kv_quant.scale_kv_range(model, alpha)
    tokens = list(range(3, 30))
    caches = {}

    def keep(name):
        return lambda c: caches.__setitem__(name, [t.clone() for t in c])

    base_logits = kv_quant.decode_logits(model, tokens, keep("base"))
    scaled_logits = kv_quant.decode_logits(scaled, tokens, keep("scaled"))
    torch.testing.assert_close(scaled_logits, base_logits, atol=1e-3, rtol=1e-3)
    for base, big in zip(caches["base"], caches["scaled"], strict=True):
        torch.testing.assert_close(big, base * alpha, atol=1e-5 * alpha, rtol=1e-4)
    # the original model is untouched
    torch.testing.assert_close(kv_quant.decode_logits(model, tokens), base_logits)


@pytest.mark.parametrize("alpha", [1e-3, 2000.0])
def test_uncalibrated_scale_fails_when_the_range_is_far_from_one(hf_checkpoint, alpha):
    # alpha 2000: K and V far beyond 448, clipped; alpha 1e-3: most of them flushed to 0
    model = load_model(hf_checkpoint("llama")[0]).model
    tokens = list(range(5, 45))
    wide = kv_quant.scale_kv_range(model, alpha)
    exact = kv_quant.decode_logits(wide, tokens)

    def error(scale):
        logits = kv_quant.decode_logits(
            wide, tokens, lambda c: kv_quant.quantize_kv_caches_(c, scale)
        )
        return (logits - exact).abs().max().item()

    assert error(1.0) > 10 * error(None)
