"""Tensors past 2^31 elements, on a GPU: every offset that can pass 2^31 is computed in
64 bits (slots, cache rows, token rows), and the value/key distance in the cache becomes a
64-bit argument. About 9 GiB of GPU memory."""

import pytest
import torch
from kernel_testing import ATTENTION_TOLERANCE, TOLERANCE, assert_close

from kernels.flash_attention import flash_attention, flash_attention_reference
from kernels.kv_cache import reshape_and_cache
from kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from kernels.rmsnorm import rms_norm, rms_norm_reference

pytestmark = pytest.mark.gpu


def dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def test_a_kv_cache_past_2_to_the_31_elements():
    kv_dtype, block_size, kv_heads, head_dim = dtype(), 16, 8, 128
    num_blocks = 70_000  # 2 x 70,000 x 16 x 8 x 128 = 2.29e9 elements
    cache = torch.zeros(
        2, num_blocks, block_size, kv_heads, head_dim, dtype=kv_dtype, device="cuda"
    )
    assert cache.numel() > 2**31
    last = torch.arange(num_blocks - 8, num_blocks, device="cuda", dtype=torch.int32)
    cache[:, num_blocks - 8 :].normal_()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(kv_dtype)

    # the store, into the last block
    k, v = randn(5, kv_heads, head_dim), randn(5, kv_heads, head_dim)
    slots = torch.arange(5, device="cuda") + (num_blocks - 1) * block_size
    reshape_and_cache(k, v, cache, slots)
    assert torch.equal(cache[0, -1, :5], k) and torch.equal(cache[1, -1, :5], v)
    # decode over the last 8 blocks, in two orders
    q = randn(2, 32, head_dim)
    tables = torch.stack([last, last.flip(0)])
    lens = torch.tensor([128, 77], dtype=torch.int32, device="cuda")
    out = paged_decode_attention(q, cache, tables, lens, head_dim**-0.5, 128)
    expected = paged_decode_attention_reference(q, cache, tables, lens, head_dim**-0.5)
    assert_close(out, expected, ATTENTION_TOLERANCE[kv_dtype])
    # a prefill chunk over a prefix held in those blocks
    q, k, v = randn(16, 32, head_dim), randn(16, kv_heads, head_dim), randn(16, kv_heads, head_dim)
    cu_seqlens = torch.tensor([0, 16], dtype=torch.int32, device="cuda")
    prefix = dict(
        kv_cache=cache,
        block_tables=last[None].contiguous(),
        prefix_lens=torch.tensor([100], dtype=torch.int32, device="cuda"),
    )
    out = flash_attention(q, k, v, cu_seqlens, 16, head_dim**-0.5, **prefix)
    expected = flash_attention_reference(q, k, v, cu_seqlens, head_dim**-0.5, **prefix)
    assert_close(out, expected, ATTENTION_TOLERANCE[kv_dtype])


def test_rms_norm_past_2_to_the_31_elements():
    rows, hidden = (1 << 31) // 4096 + 16, 4096
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype())
    weight = torch.randn(hidden, device="cuda", dtype=dtype())
    y = rms_norm(x, weight, 1e-5)
    assert_close(y[-32:], rms_norm_reference(x[-32:], weight, 1e-5), TOLERANCE[dtype()])
