"""Attention beyond dense causal attention, on small tensors: cascade, sinks and sparsity.

Cascade attention (FlashInfer's name; vLLM's FlashAttention backend has it too). When many
requests share a long prefix, every query attends to the prefix's keys and values in one
pass, so the prefix's KV is read once instead of once per request; each request then
attends to its own suffix, and the two partial results are merged exactly with the
log-sum-exp merge of split-KV decoding (`kernels.paged_decode`):

    out = (w_p o_p + w_s o_s) / (w_p + w_s),  w = exp(lse - max(lse_p, lse_s))

Attention sinks. Xiao et al. (2023, "Efficient streaming language models with attention
sinks") observe that the first tokens take a large share of attention; gpt-oss learns one
sink logit z per head that joins the softmax's denominator without a value:

    p_t = exp(s_t) / (exp(z) + sum_u exp(s_u))

Sparse attention. Each query attends to a chosen subset of the keys: a sliding window, a
block pattern, or the top-k keys by score (DeepSeek's DSA picks them with a lightweight
indexer). `topk_attention` keeps the k largest scores exactly.

Shapes: one decode query per sequence, q: [num_seqs, num_heads, head_dim]; keys and values
[num_keys, num_heads, head_dim] (one KV head per query head, to keep the counts plain).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

# kernels first: without a GPU it switches Triton's interpreter on before Triton loads
from kernels.paged_decode import _merge_splits_kernel
from minillm.model import llama

LOG2_E = 1.4426950408889634


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query over all the keys: (out [num_seqs, heads, head_dim], lse [num_seqs, heads]).

    q: [num_seqs, heads, head_dim]; k, v: [num_keys, heads, head_dim]; lse in natural log."""
    scores = torch.einsum("shd,khd->shk", q, k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("shk,khd->shd", torch.exp(scores - lse[..., None]), v), lse


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Merge partial attention results with minillm's split-KV merge kernel.

    outs: [rows, parts, head_dim] float32, each part normalized over its own keys;
    lses: [rows, parts] float32, natural log (the kernel works in base 2, so they are scaled
    by log2(e) here). Returns [rows, head_dim] float32: attention over all the parts' keys."""
    if outs.dim() != 3 or lses.shape != outs.shape[:2]:
        raise ValueError(
            f"outs must be [rows, parts, head_dim] and lses [rows, parts], got "
            f"{list(outs.shape)} and {list(lses.shape)}"
        )
    rows, parts, head_dim = outs.shape
    partial_out = outs.float().contiguous()
    partial_lse = (lses.float() * LOG2_E).contiguous()
    out = torch.empty(rows, head_dim, dtype=torch.float32, device=outs.device)
    _merge_splits_kernel[(rows,)](
        partial_out,
        partial_lse,
        out,
        parts,
        HEAD_DIM=head_dim,
        BLOCK_S=_next_power_of_2(parts),
        BLOCK_D=max(16, _next_power_of_2(head_dim)),
        num_warps=4,
    )
    return out


def cascade_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    suffix_k: list[torch.Tensor],
    suffix_v: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Decode attention of num_seqs sequences sharing one prefix, in two passes and a merge.

    q: [num_seqs, heads, head_dim]; prefix_k, prefix_v: [prefix_len, heads, head_dim], read
    once for all queries; suffix_k[i], suffix_v[i]: [suffix_len_i, heads, head_dim], request
    i's own tokens (at least one). Returns [num_seqs, heads, head_dim] float32."""
    if len(suffix_k) != q.shape[0] or len(suffix_v) != q.shape[0]:
        raise ValueError(f"need one suffix per sequence ({q.shape[0]}), got {len(suffix_k)}")
    prefix_out, prefix_lse = attention_with_lse(q, prefix_k, prefix_v, scale)  # one pass
    suffix = [
        attention_with_lse(q[i : i + 1], k, v, scale)
        for i, (k, v) in enumerate(zip(suffix_k, suffix_v, strict=True))
    ]
    suffix_out = torch.cat([o for o, _ in suffix])
    suffix_lse = torch.cat([lse for _, lse in suffix])
    num_seqs, heads, head_dim = q.shape
    outs = torch.stack([prefix_out, suffix_out], dim=2).reshape(num_seqs * heads, 2, head_dim)
    lses = torch.stack([prefix_lse, suffix_lse], dim=2).reshape(num_seqs * heads, 2)
    return merge_attention_states(outs, lses).reshape(num_seqs, heads, head_dim)


def cascade_kv_bytes(
    prefix_len: int, suffix_lens: list[int], num_kv_heads: int, head_dim: int, itemsize: int
) -> tuple[int, int]:
    """(bytes of K and V read without cascade, with cascade) for one decode step of one layer.

    Without: every request reads its whole context, sum_i (prefix_len + suffix_len_i) tokens.
    With: the prefix once, plus every suffix: prefix_len + sum_i suffix_len_i tokens. Each
    token is 2 (K and V) x num_kv_heads x head_dim x itemsize bytes."""
    per_token = 2 * num_kv_heads * head_dim * itemsize
    without = sum(prefix_len + s for s in suffix_lens) * per_token
    return without, (prefix_len + sum(suffix_lens)) * per_token


def softmax_with_sink(scores: torch.Tensor, sink_logit: float) -> torch.Tensor:
    """p_t = exp(s_t) / (exp(z) + sum_u exp(s_u)) over the last dim: gpt-oss's learned sink
    logit z takes a share of the probability and contributes no value, so the weights sum to
    less than 1."""
    sink = torch.full((*scores.shape[:-1], 1), float(sink_logit), dtype=scores.dtype)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def topk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, top_k: int
) -> torch.Tensor:
    """Each query attends to its top_k highest-scoring keys only (exact scores, no indexer).

    q: [num_queries, head_dim]; k, v: [num_keys, head_dim]; returns [num_queries, head_dim]."""
    scores = (q @ k.T) * scale
    top_k = min(top_k, k.shape[0])
    kept, index = scores.topk(top_k, dim=-1)
    return torch.einsum("qk,qkd->qd", torch.softmax(kept, dim=-1), v[index])


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """The reference for `topk_attention`: q [num_queries, head_dim] over every key."""
    return torch.softmax((q @ k.T) * scale, dim=-1) @ v


@contextmanager
def capture_attention_inputs():
    """Record (q, k, v) of every layer while a model runs `forward_causal`.

    Yields a list that fills with one (q, k, v) per layer, each [batch, seq, heads, head_dim]
    after RoPE (k and v with the KV heads), as `minillm.model.llama.causal_attention` gets."""
    original = llama.causal_attention
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def recording(q, k, v, scale):
        captured.append((q.detach(), k.detach(), v.detach()))
        return original(q, k, v, scale)

    llama.causal_attention = recording
    try:
        yield captured
    finally:
        llama.causal_attention = original


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax weights of one sequence: q [seq, heads, d], k [seq, kv_heads, d] ->
    [heads, seq, seq] (query head h reads KV head h // (heads / kv_heads))."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    seq = q.shape[0]
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(mask, -math.inf), dim=-1)


def causal_topk_errors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, top_ks: list[int], last: int
) -> torch.Tensor:
    """Relative error |o_topk - o| / |o| of top-k against dense causal attention.

    q: [seq, heads, d]; k, v: [seq, kv_heads, d] (grouped as in `attention_probs`). For each
    of the last `last` queries and every head, keeps its top_k highest-scoring visible keys.
    Returns [len(top_ks), heads * last]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    seq = q.shape[0]
    queries = q[seq - last :].float()
    scores = torch.einsum("qhd,khd->hqk", queries, k) * scale  # [heads, last, seq]
    visible = torch.arange(seq)[None, :] <= torch.arange(seq - last, seq)[:, None]
    scores = scores.masked_fill(~visible, -math.inf)
    dense = torch.einsum("hqk,khd->hqd", torch.softmax(scores, -1), v)
    errors = []
    for top_k in top_ks:
        kept, index = scores.topk(min(top_k, seq), dim=-1)
        picked = v.permute(1, 0, 2)[torch.arange(v.shape[1])[:, None, None], index]
        out = torch.einsum("hqk,hqkd->hqd", torch.softmax(kept, -1), picked)
        errors.append(((out - dense).norm(dim=-1) / dense.norm(dim=-1)).flatten())
    return torch.stack(errors)
