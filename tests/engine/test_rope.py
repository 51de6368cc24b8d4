"""RoPE frequencies (llama3 scaling) against transformers, and the rotation itself."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.model.rope import (
    RotaryEmbedding,
    apply_rope,
    apply_rope_tables,
    rope_inv_freq,
    rope_tables,
)


def hf_llama3_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={**rope_scaling, "rope_theta": rope_theta},
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_scaling == 1.0
    return inv_freq


@given(
    head_dim=st.integers(1, 64).map(lambda n: 2 * n),
    rope_theta=st.sampled_from([10000.0, 500000.0, 1000000.0]),
    factor=st.floats(1.0, 64.0),
    low_freq_factor=st.floats(0.5, 2.0),
    band_ratio=st.floats(1.5, 8.0),
    original_max_position_embeddings=st.sampled_from([16, 64, 1024, 8192]),
)
def test_llama3_inv_freq_matches_transformers(
    head_dim, rope_theta, factor, low_freq_factor, band_ratio, original_max_position_embeddings
):
    rope_scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low_freq_factor,
        "high_freq_factor": low_freq_factor * band_ratio,
        "original_max_position_embeddings": original_max_position_embeddings,
    }
    expected = hf_llama3_inv_freq(head_dim, rope_theta, rope_scaling)
    actual = rope_inv_freq(head_dim, rope_theta, rope_scaling)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)


def test_llama3_bands_on_llama_3_1_8b():
    # Llama 3.1 8B: head_dim 128, theta 500000, factor 8 over an 8192-token pre-training context
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert high.sum() == 29 and low.sum() == 29  # 6 pairs in the interpolated band
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    middle = ~high & ~low
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


def test_inv_freq_without_scaling():
    expected = torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)])
    torch.testing.assert_close(rope_inv_freq(8, 10000.0, None), expected)


def test_unsupported_rope_type_is_rejected():
    with pytest.raises(ValueError, match="llama3"):
        rope_inv_freq(8, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_apply_rope_is_complex_rotation_of_half_pairs():
    # oracle: pair i is the complex number x[i] + 1j * x[i + d/2], rotated by e^(1j * p * f_i)
    head_dim, theta = 8, 100.0
    positions = torch.tensor([0, 1, 5, 77])
    x = torch.randn(4, 3, head_dim, dtype=torch.float64)
    cos, sin = RotaryEmbedding(head_dim, theta, None)(positions, torch.float64)
    actual = apply_rope(x, cos, sin)
    freqs = torch.tensor([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)])
    z = torch.complex(x[..., : head_dim // 2], x[..., head_dim // 2 :])
    rotated = z * torch.polar(
        torch.ones(4, 1, head_dim // 2, dtype=torch.float64),
        positions[:, None, None] * freqs.double(),
    )
    expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(0, 500))
def test_rope_scores_depend_only_on_relative_position(m, n, shift):
    rope = RotaryEmbedding(16, 10000.0, None)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 16, generator=gen, dtype=torch.float64)
    # the angles are float32 (as in transformers), so scores agree to ~1e-3 at position 1000

    def score(pos_q: int, pos_k: int) -> float:
        cos, sin = rope(torch.tensor([pos_q, pos_k]), torch.float64)
        rq, rk = apply_rope(torch.stack([q, k]), cos, sin)
        return float((rq * rk).sum())

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=5e-3)
    cos, sin = rope(torch.tensor([m]), torch.float64)
    assert float(apply_rope(q[None], cos, sin).norm()) == pytest.approx(float(q.norm()), rel=1e-6)


def test_frequencies_stay_float32_when_the_model_is_cast():
    rope = RotaryEmbedding(16, 10000.0, None)
    cos, _ = rope(torch.tensor([100000]), torch.bfloat16)
    assert cos.dtype == torch.bfloat16
    assert rope.inv_freq.dtype == torch.float32


@settings(deadline=None)
@given(
    tokens=st.integers(1, 6),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 8, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_rope_tables_rotate_bit_for_bit_like_apply_rope(tokens, heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(1, 100_000, (tokens,), generator=gen)  # sin 0 at 0
    x = (torch.randn(tokens, heads, head_dim, generator=gen) * 10).to(dtype)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None)(positions, dtype)
    expected = apply_rope(x, cos, sin)
    assert torch.equal(apply_rope_tables(x, *rope_tables(cos, sin)), expected)
    # the sign belongs to the first half: negating the second (rotating the other way) or
    # forgetting it is caught
    wrong = torch.cat((sin[..., : head_dim // 2], -sin[..., head_dim // 2 :]), dim=-1)
    assert not torch.equal(apply_rope_tables(x, cos.unsqueeze(-2), wrong.unsqueeze(-2)), expected)
    assert not torch.equal(apply_rope_tables(x, cos.unsqueeze(-2), sin.unsqueeze(-2)), expected)
