"""Cascade attention equals full attention; the byte counts, the sink softmax and top-k
attention match computations written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from minillm.lab.attention_variants import (
    attention_probs,
    cascade_attention,
    cascade_kv_bytes,
    causal_topk_errors,
    dense_attention,
    merge_attention_states,
    softmax_with_sink,
    topk_attention,
)


def full_attention(q, k, v, scale):
    """One query over all keys, in float64, head by head: shares no code with the module."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        s = (k[:, h].double() @ q[h].double()) * scale
        p = torch.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h].double()
    return out


@pytest.mark.parametrize("suffix_lens", [[1], [3, 10, 1, 40, 7], [17] * 9])
def test_cascade_attention_equals_full_attention(suffix_lens):
    torch.manual_seed(len(suffix_lens))
    heads, head_dim, prefix_len = 4, 32, 300
    q = torch.randn(len(suffix_lens), heads, head_dim)
    prefix_k, prefix_v = torch.randn(2, prefix_len, heads, head_dim)
    suffix_k = [3 * torch.randn(n, heads, head_dim) for n in suffix_lens]
    suffix_v = [torch.randn(n, heads, head_dim) for n in suffix_lens]
    out = cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, head_dim**-0.5)
    for i in range(len(suffix_lens)):
        k = torch.cat([prefix_k, suffix_k[i]])
        v = torch.cat([prefix_v, suffix_v[i]])
        ref = full_attention(q[i], k, v, head_dim**-0.5)
        assert torch.allclose(out[i].double(), ref, atol=1e-5)


def test_merge_ignores_an_empty_part_and_weighs_by_lse():
    outs = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[2.0, 2.0], [5.0, 5.0]]])
    lses = torch.tensor([[0.0, math.log(3.0)], [1.0, -math.inf]])
    merged = merge_attention_states(outs, lses)
    assert torch.allclose(merged[0], torch.tensor([0.25, 0.75]), atol=1e-6)
    assert torch.allclose(merged[1], torch.tensor([2.0, 2.0]), atol=1e-6)


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="rows, parts"):
        merge_attention_states(torch.zeros(3, 2, 8), torch.zeros(3, 3))


def test_cascade_kv_bytes_by_hand():
    # 8 requests share 1,000 tokens, each adds 10; 2 KV heads of 64 dims in 2 bytes:
    # 2 (K, V) x 2 x 64 x 2 = 512 bytes per token
    without, with_cascade = cascade_kv_bytes(1000, [10] * 8, 2, 64, 2)
    assert without == 8 * 1010 * 512
    assert with_cascade == (1000 + 80) * 512
    assert cascade_kv_bytes(0, [5, 6], 1, 1, 1) == (22, 22)


def test_sink_scales_every_weight_by_the_same_factor():
    scores = torch.tensor([[1.0, 2.0, 0.5]])
    z = 1.5
    weights = softmax_with_sink(scores, z)
    total = math.exp(1.0) + math.exp(2.0) + math.exp(0.5)
    expected = torch.tensor([[math.exp(1.0), math.exp(2.0), math.exp(0.5)]]) / (total + math.exp(z))
    assert torch.allclose(weights, expected)
    assert torch.allclose(
        weights / torch.softmax(scores, -1), torch.tensor(total / (total + math.exp(z)))
    )
    assert torch.allclose(softmax_with_sink(scores, -math.inf), torch.softmax(scores, -1))


def test_topk_attention_keeps_the_largest_scores():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 16), torch.randn(50, 16), torch.randn(50, 8)
    assert torch.allclose(
        topk_attention(q, k, v, 0.25, 50), dense_attention(q, k, v, 0.25), atol=1e-6
    )
    out = topk_attention(q, k, v, 0.25, 5)
    for i in range(3):
        s = (k @ q[i]) * 0.25
        keep = s.argsort(descending=True)[:5]
        p = torch.softmax(s[keep], 0)
        assert torch.allclose(out[i], p @ v[keep], atol=1e-6)


def test_attention_probs_is_causal_and_groups_heads():
    torch.manual_seed(1)
    q, k = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    p = attention_probs(q, k, 0.5)
    assert p.shape == (4, 6, 6)
    assert torch.allclose(p.sum(-1), torch.ones(4, 6))
    assert torch.all(p.triu(1) == 0)
    expected = torch.softmax((k[:3, 1] @ q[2, 3]) * 0.5, 0)  # query head 3 reads KV head 1
    assert torch.allclose(p[3, 2, :3], expected)


def test_causal_topk_errors_against_single_queries():
    torch.manual_seed(2)
    seq, heads, kv_heads, d = 20, 4, 2, 8
    q, k, v = (
        torch.randn(seq, heads, d),
        torch.randn(seq, kv_heads, d),
        torch.randn(seq, kv_heads, d),
    )
    errors = causal_topk_errors(q, k, v, 0.3, [3, seq], last=5)
    assert errors.shape == (2, heads * 5)
    assert torch.all(errors[1] < 1e-5)  # every visible key kept: dense attention
    # head 1, query at position 16 (the second of the last five): keys 0..16, KV head 0
    kk, vv = k[:17, 0], v[:17, 0]
    dense = dense_attention(q[16:17, 1], kk, vv, 0.3)
    sparse = topk_attention(q[16:17, 1], kk, vv, 0.3, 3)
    expected = ((sparse - dense).norm() / dense.norm()).item()
    assert abs(errors[0, 1 * 5 + 1].item() - expected) < 1e-5
