"""kernels.rope against its complex-rotation reference and the engine's RoPE."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES, TOLERANCE, assert_close

from kernels.rope import (
    apply_rope,
    apply_rope_reference,
    rope_bytes,
    rope_cos_sin_cache,
    rope_flops,
)
from minillm.model.rope import rope_inv_freq

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small: all three frequency bands occur
}


@settings(max_examples=15)
@given(
    num_tokens=st.integers(0, 9),
    num_kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([8, 24, 32, 64, 128]),
    rope_scaling=st.sampled_from([None, LLAMA3]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rope_matches_reference(
    num_tokens, num_kv_heads, group, head_dim, rope_scaling, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    max_position = 2048
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    q, k = q.to(DEVICE, dtype), k.to(DEVICE, dtype)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(DEVICE)
    cache = rope_cos_sin_cache(
        rope_inv_freq(head_dim, 500000.0, rope_scaling), max_position, DEVICE
    )
    q_out, k_out = apply_rope(q, k, positions, cache)
    q_ref, k_ref = apply_rope_reference(
        q, k, positions, rope_inv_freq(head_dim, 500000.0, rope_scaling)
    )
    assert_close(q_out, q_ref, TOLERANCE[dtype])
    assert_close(k_out, k_ref, TOLERANCE[dtype])


def test_rope_equals_the_engine_rope_in_float32():
    from minillm.model.rope import RotaryEmbedding
    from minillm.model.rope import apply_rope as engine_apply_rope

    q, k = torch.randn(5, 8, 64, device=DEVICE), torch.randn(5, 2, 64, device=DEVICE)
    positions = torch.tensor([0, 1, 17, 300, 4095], device=DEVICE)
    cos, sin = RotaryEmbedding(64, 10000.0, LLAMA3)(positions, torch.float32)
    cache = rope_cos_sin_cache(rope_inv_freq(64, 10000.0, LLAMA3), 4096, DEVICE)
    q_out, k_out = apply_rope(q, k, positions, cache)
    torch.testing.assert_close(q_out, engine_apply_rope(q, cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, engine_apply_rope(k, cos, sin), atol=1e-6, rtol=1e-6)


def test_position_zero_is_the_identity_and_positions_broadcast():
    # [batch, seq, heads, d] with positions [seq], as the model's cache-free forward has
    q, k = torch.randn(2, 3, 4, 16, device=DEVICE), torch.randn(2, 3, 1, 16, device=DEVICE)
    cache = rope_cos_sin_cache(rope_inv_freq(16, 10000.0, None), 8, DEVICE)
    q_out, k_out = apply_rope(q, k, torch.arange(3, device=DEVICE), cache)
    assert torch.equal(q_out[:, 0], q[:, 0]) and torch.equal(k_out[:, 0], k[:, 0])
    assert not torch.allclose(q_out[:, 1], q[:, 1])
    q_ref, _ = apply_rope_reference(
        q, k, torch.arange(3, device=DEVICE), rope_inv_freq(16, 10000.0, None)
    )
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)


def test_cos_sin_cache_layout():
    cache = rope_cos_sin_cache(rope_inv_freq(4, 100.0, None), 3)
    # inv_freq = [1, 100^-0.5] = [1, 0.1]; row p = cos(p w), sin(p w)
    angles = torch.tensor([[0.0, 0.0], [1.0, 0.1], [2.0, 0.2]])
    torch.testing.assert_close(cache, torch.cat((angles.cos(), angles.sin()), dim=-1))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, p, c: (q.half(), k, p, c), "k must be float16"),
        (lambda q, k, p, c: (q, k[..., :8], p, c), r"k must have shape \[4, \*, 16\]"),
        (lambda q, k, p, c: (q, k, p.float(), c), "positions must be int32 or int64"),
        (lambda q, k, p, c: (q, k, p[:3], c), "positions must broadcast"),
        (lambda q, k, p, c: (q, k, p, c.half()), "cos_sin_cache must be float32"),
        (lambda q, k, p, c: (q, k, p, c[:, :8]), r"cos_sin_cache must have shape \[\*, 16\]"),
        (lambda q, k, p, c: (q[..., :15], k, p, c), "even head_dim"),
        (lambda q, k, p, c: (q[:2], k, p, c), r"k must have shape \[2, \*, 16\]"),
        (lambda q, k, p, c: (q[:, ::2], k, p, c), "q must be contiguous"),
        (lambda q, k, p, c: (q, k, p.to("meta"), c), "positions must be on"),
    ],
)
def test_bad_input_is_rejected_before_launch(change, message):
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    positions, cache = torch.arange(4), rope_cos_sin_cache(rope_inv_freq(16, 10000.0, None), 8)
    args = change(q.to(DEVICE), k.to(DEVICE), positions.to(DEVICE), cache.to(DEVICE))
    with pytest.raises(ValueError, match=message):
        apply_rope(*args)


def test_cost_model():
    # 2 tokens, 4 + 2 heads of 8 float16 values: 2 * 2 * 6 * 8 * 2 bytes, plus 2 rows of 8 floats
    assert rope_bytes(2, 4, 2, 8, 2) == 2 * 2 * 6 * 8 * 2 + 2 * 8 * 4
    assert rope_flops(2, 4, 2, 8) == 3 * 2 * 6 * 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_at_real_sizes(dtype):
    q = torch.randn(8192, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(8192, 8, 128, device="cuda", dtype=dtype)
    positions = torch.randint(0, 131072, (8192,), device="cuda")
    cache = rope_cos_sin_cache(rope_inv_freq(128, 500000.0, LLAMA3), 131072, "cuda")
    q_out, k_out = apply_rope(q, k, positions, cache)
    q_ref, k_ref = apply_rope_reference(q, k, positions, rope_inv_freq(128, 500000.0, LLAMA3))
    assert_close(q_out, q_ref, TOLERANCE[dtype])
    assert_close(k_out, k_ref, TOLERANCE[dtype])
