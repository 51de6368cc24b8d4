"""Paged attention against dense causal attention over unpaged K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from minillm.model.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    get_attention_backend,
    write_kv_cache,
)


def dense_attention(q, k, v, scale):
    """q: [q_len, h, d] at the last q_len of seq_len positions; k, v: [seq_len, kv_h, d]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    visible = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=visible,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@st.composite
def paged_batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    num_heads = num_kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([4, 8]))
    seqs = draw(
        st.lists(
            st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
            min_size=1,
            max_size=4,
        )
    )
    seed = draw(st.integers(0, 2**16))
    return block_size, num_heads, num_kv_heads, head_dim, seqs, seed


@given(paged_batches())
def test_torch_backend_matches_dense_attention(batch):
    block_size, num_heads, num_kv_heads, head_dim, seqs, seed = batch
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, not contiguous
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    qs, new_ks, new_vs, slots, expected, full_kv = [], [], [], [], [], []
    query_start_loc = [0]
    for i, (seq_len, q_len) in enumerate(seqs):
        table = [order.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(table)] = torch.tensor(table)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        q = torch.randn(q_len, num_heads, head_dim, generator=gen)
        for pos in range(seq_len):
            block, offset = table[pos // block_size], pos % block_size
            if pos < seq_len - q_len:  # context computed by earlier steps: already cached
                kv_cache[0, block, offset], kv_cache[1, block, offset] = k[pos], v[pos]
            else:
                slots.append(block * block_size + offset)
        qs.append(q)
        new_ks.append(k[seq_len - q_len :])
        new_vs.append(v[seq_len - q_len :])
        query_start_loc.append(query_start_loc[-1] + q_len)
        expected.append(dense_attention(q, k, v, scale=0.3))
        full_kv.append((table, k, v))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q for _, q in seqs),
        max_seq_len=max(s for s, _ in seqs),
        block_size=block_size,
    )
    out = get_attention_backend("torch").forward(
        torch.cat(qs), torch.cat(new_ks), torch.cat(new_vs), kv_cache, meta, scale=0.3
    )
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
    # the new tokens' K/V landed in their slots
    for table, k, v in full_kv:
        for pos in range(k.shape[0]):
            block, offset = table[pos // block_size], pos % block_size
            assert torch.equal(kv_cache[0, block, offset], k[pos])
            assert torch.equal(kv_cache[1, block, offset], v[pos])


def test_write_kv_cache_slot_is_block_and_offset():
    kv_cache = torch.zeros(2, 3, 4, 1, 2)
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    write_kv_cache(k, -k, kv_cache, torch.tensor([5, 11]))
    assert kv_cache[0, 1, 1].tolist() == [[1.0, 2.0]]  # slot 5 = block 1, offset 1
    assert kv_cache[1, 2, 3].tolist() == [[-3.0, -4.0]]  # slot 11 = block 2, offset 3
    assert kv_cache.count_nonzero() == 8


def test_write_kv_cache_casts_to_cache_dtype():
    kv_cache = torch.zeros(2, 1, 2, 1, 2, dtype=torch.bfloat16)
    write_kv_cache(torch.ones(1, 1, 2), torch.ones(1, 1, 2), kv_cache, torch.tensor([1]))
    assert kv_cache[:, 0, 1].float().sum() == 4


def test_backend_registry():
    assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*'torch'"):
        get_attention_backend("flash")
