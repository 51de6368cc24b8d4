"""kernels.paged_decode against a token-by-token float64 reference."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import ATTENTION_TOLERANCE, DEVICE, DTYPES, assert_close, random_block_tables

from kernels.paged_decode import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_bytes,
    paged_decode_flops,
)


def make_inputs(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    max_num_blocks = max(1, *(-(-n // block_size) for n in seq_lens))
    num_blocks = max_num_blocks + 2
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    block_tables = random_block_tables(len(seq_lens), max_num_blocks, num_blocks, gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (
        q.to(DEVICE, dtype),
        kv_cache.to(DEVICE, dtype),
        block_tables.to(DEVICE),
        seq_lens.to(DEVICE),
    )


@given(
    seq_lens=st.lists(st.integers(0, 90), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([32, 64, 128]),
    block_size=st.sampled_from([8, 16, 32]),
    num_splits=st.sampled_from([None, 1, 2, 5]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_paged_decode_matches_reference(
    seq_lens, group, head_dim, block_size, num_splits, dtype, seed
):
    num_kv_heads = 1 if group >= 4 else 2
    q, kv_cache, block_tables, lens = make_inputs(
        seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    out = paged_decode_attention(q, kv_cache, block_tables, lens, scale, max(seq_lens), num_splits)
    expected = paged_decode_attention_reference(q, kv_cache, block_tables, lens, scale)
    assert_close(out, expected, ATTENTION_TOLERANCE[dtype])


def test_the_merge_of_many_splits_equals_one_split():
    # 70 keys in 1, 3 or 8 splits (8 splits of 32-key tiles: the last splits are empty)
    q, kv_cache, block_tables, lens = make_inputs([70, 3, 0], 2, 2, 32, 8, torch.float32, 0)
    one = paged_decode_attention(q, kv_cache, block_tables, lens, 0.3, 70, num_splits=1)
    for num_splits in (3, 8):
        many = paged_decode_attention(q, kv_cache, block_tables, lens, 0.3, 70, num_splits)
        torch.testing.assert_close(many, one, atol=1e-6, rtol=1e-5)
    # no context: the output is 0, not NaN
    assert torch.equal(one[2], torch.zeros_like(one[2]))


def test_one_token_context_returns_its_value():
    q, kv_cache, block_tables, lens = make_inputs([1], 1, 4, 32, 16, torch.float32, 3)
    out = paged_decode_attention(q, kv_cache, block_tables, lens, 0.2, 1, num_splits=2)
    value = kv_cache[1, block_tables[0, 0], 0, 0]
    torch.testing.assert_close(out[0], value.expand(4, 32), atol=1e-6, rtol=1e-6)


def test_decode_equals_the_last_row_of_prefill():
    # the query of the last position of a prefill sees exactly what a decode step sees
    from kernels.flash_attention import flash_attention

    q, kv_cache, block_tables, lens = make_inputs([45], 2, 2, 64, 16, torch.float32, 4)
    k = kv_cache[0][block_tables[0].long()].flatten(0, 1)[:45].contiguous()
    v = kv_cache[1][block_tables[0].long()].flatten(0, 1)[:45].contiguous()
    queries = torch.randn(45, 4, 64, device=DEVICE)
    queries[-1] = q[0]
    cu_seqlens = torch.tensor([0, 45], dtype=torch.int32, device=DEVICE)
    prefill = flash_attention(queries, k, v, cu_seqlens, 45, 0.125)
    decode = paged_decode_attention(q, kv_cache, block_tables, lens, 0.125, 45, num_splits=3)
    torch.testing.assert_close(decode[0], prefill[-1], atol=1e-6, rtol=1e-5)


def test_choose_num_splits():
    # batch 1, 8 KV heads on 132 SMs: 264 / 8 = 33 splits wanted, 4096 keys allow them
    min_keys = MIN_KEYS_PER_SPLIT
    assert choose_num_splits(1, 8, 33 * min_keys, 132) == 33
    # a short context limits the splits: at most ceil(context / MIN_KEYS_PER_SPLIT)
    assert choose_num_splits(1, 8, 2 * min_keys, 132) == 2
    assert choose_num_splits(1, 8, 1, 132) == 1
    # a big batch fills the device alone
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(1, 1, 10**6, 1000) == MAX_SPLITS


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("q", lambda t: t.to(torch.int8), "q must be float16 or bfloat16 or float32"),
        ("q", lambda t: t[0], r"q must have shape \[num_seqs, num_heads, head_dim\]"),
        ("kv_cache", lambda t: t[..., :16], r"kv_cache must have shape \[2, \*, \*, \*, 32\]"),
        ("kv_cache", lambda t: t.expand(2, -1, -1, 3, -1), r"num_kv_heads \(3\) must divide"),
        ("kv_cache", lambda t: t.double(), "kv_cache must be float32"),
        ("kv_cache", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "contiguous"),
        ("block_tables", lambda t: t[:1], r"block_tables must have shape \[2, \*\]"),
        ("block_tables", lambda t: t.long(), "block_tables must be int32"),
        ("seq_lens", lambda t: t.long(), "seq_lens must be int32"),
        ("seq_lens", lambda t: t.to("meta"), "seq_lens must be on"),
        ("num_splits", lambda n: 0, r"num_splits must be in \[1, 64\]"),
    ],
)
def test_bad_input_is_rejected_before_launch(name, change, message):
    q, kv_cache, block_tables, lens = make_inputs([5, 9], 1, 4, 32, 8, torch.float32, 0)
    args = dict(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=lens, num_splits=2)
    args[name] = change(args[name])
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(scale=0.1, max_seq_len=9, **args)


def test_cost_model():
    # 2 sequences of 100 and 28 tokens, 8 query heads on 2 KV heads of 128, float16
    assert paged_decode_flops([100, 28], 8, 128) == 4 * 128 * 8 * 128
    kv_bytes, q_out_bytes = 2 * 2 * 128 * 128 * 2, 2 * 2 * 8 * 128 * 2
    assert paged_decode_bytes([100, 28], 8, 2, 128, 2) == kv_bytes + q_out_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "context"), [(1, 32768), (64, 4096)])
def test_paged_decode_at_real_sizes(dtype, batch, context):
    seq_lens = [context - 37 * i for i in range(batch)]
    q, kv_cache, block_tables, lens = make_inputs(seq_lens, 8, 4, 128, 16, dtype, seed=0)
    out = paged_decode_attention(q, kv_cache, block_tables, lens, 128**-0.5, context)
    expected = paged_decode_attention_reference(q, kv_cache, block_tables, lens, 128**-0.5)
    assert_close(out, expected, ATTENTION_TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 8, 32, 64])  # BLOCK_G 16, 16, 32, 64 (MQA at 64)
def test_paged_decode_groups_and_splits_on_the_gpu(group):
    """GQA groups past 16 query heads (larger BLOCK_G, Hopper's wgmma at 64), split counts
    up to MAX_SPLITS with empty splits, and contexts of 0, 1 and around a tile's edges."""
    dtype = torch.bfloat16 if torch.bfloat16 in DTYPES else torch.float16
    seq_lens = [0, 1, 15, 16, 17, 63, 64, 65, 1000, 4096, 32768]
    num_kv_heads = 1 if group >= 32 else 2
    q, kv_cache, block_tables, lens = make_inputs(
        seq_lens, num_kv_heads, group, 128, 16, dtype, seed=group
    )
    expected = paged_decode_attention_reference(q, kv_cache, block_tables, lens, 128**-0.5)
    for num_splits in (None, 1, 3, 33, MAX_SPLITS):
        out = paged_decode_attention(
            q, kv_cache, block_tables, lens, 128**-0.5, max(seq_lens), num_splits
        )
        assert_close(out, expected, ATTENTION_TOLERANCE[dtype])
