"""Paged decode attention with split-KV (Flash-Decoding) and a log-sum-exp merge.

Math. In a decode step each sequence has one new query q (per head), at the last position
of its seq_len-token context, and attends to all of it: out = sum_t softmax_t(scale q.k_t)
v_t, over keys and values read from the paged KV cache through the sequence's block table
(token t in block block_tables[b, t // block_size] at offset t % block_size). Query head h
reads KV head h // (num_heads / num_kv_heads).

Split-KV (Dao, Haziza, Massa & Sizov, 2023, "Flash-Decoding for long-context inference").
One program per (sequence, KV head) is too few to fill a GPU when the batch is small and the
context long, so the context is cut into num_splits ranges that separate programs attend to
at once. Split i returns its own normalized output o_i and the log-sum-exp of its scores,
lse_i = log sum_{t in split i} exp(scale q.k_t). A second small kernel merges them exactly
(with a single split the first kernel writes out itself, and there is nothing to merge):

    out = sum_i w_i o_i / sum_i w_i,  w_i = exp(lse_i - max_j lse_j)

An empty split (past the end of a short sequence) has lse = -inf and weight 0; a sequence
with no context at all gets out = 0. The kernels work in base 2 (exp2, log2) throughout.

Choosing num_splits: enough (sequence, KV head, split) programs to fill the device about
twice over (2 programs per SM), but no more than ceil(max_seq_len / MIN_KEYS_PER_SPLIT)
splits, since much shorter splits cost more to merge than their parallelism gains; at most
MAX_SPLITS. The count depends only on host ints (batch size, head count, the max_seq_len
the caller states, SM count), never on device values, so a captured CUDA graph can replay
it. Without a GPU,
`kernels.device.NOTIONAL_SM_COUNT` stands in for the SM count.

Tiling: one program per (sequence, KV head, split) handles all query heads of the KV head's
group as one [BLOCK_G, head_dim] tile (padded to 16 rows for tl.dot), so each key and value
is read once per step, not once per query head: the GQA saving. It walks its range in
BLOCK_N-key tiles gathered through the block table, with the online softmax of
`kernels.flash_attention`.

Cost per call (num_seqs sequences, h query and h_kv KV heads, head size d, b = itemsize):
FLOPs paged_decode_flops(): 4 d h per (query, key) pair, sum_b seq_len_b pairs; bytes moved
paged_decode_bytes(): compulsory traffic, the keys and values of every context read once,
2 h_kv d b sum_b seq_len_b, plus q read and out written, 2 num_seqs h d b. Decode attention
is memory-bound: about one FLOP per byte per query head sharing a KV head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import INTERPRETED
from kernels.checks import (
    check_contiguous,
    check_device,
    check_dtype,
    check_same_device,
    check_shape,
)
from kernels.device import fit_num_stages, sm_count, tensor_core_dots

MAX_HEAD_DIM = 256
MAX_SPLITS = 64
# a split shorter than this costs more to merge than it gains (interpreter: one tile, so
# that small test contexts still split)
GPU_MIN_KEYS_PER_SPLIT = 256
MIN_KEYS_PER_SPLIT = 32 if INTERPRETED else GPU_MIN_KEYS_PER_SPLIT


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    kv_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    scale_log2e,
    block_tables_stride,
    cache_value_offset,
    num_heads,
    num_kv_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = num_heads // num_kv_heads
    seq_len = tl.load(seq_lens_ptr + seq)
    # equal shares of this sequence's context, rounded up to whole tiles
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    head_mask = g < group
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_offsets = (seq.to(tl.int64) * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        block = tl.load(
            block_tables_ptr + seq * block_tables_stride + keys // CACHE_BLOCK_SIZE,
            mask=key_mask,
            other=0,
        ).to(tl.int64)
        slot = block * CACHE_BLOCK_SIZE + keys % CACHE_BLOCK_SIZE
        kv_offsets = (slot * num_kv_heads + kv_head) * HEAD_DIM
        k_t = tl.load(
            kv_cache_ptr + kv_offsets[None, :] + dims[:, None],
            mask=key_mask[None, :] & dim_mask[:, None],
            other=0.0,
        )
        v = tl.load(
            kv_cache_ptr + cache_value_offset + kv_offsets[:, None] + dims[None, :],
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, k_t, input_precision="ieee") * scale_log2e
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # an empty split: l = 0, lse = -inf, out = 0 (its merge weight is 0)
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SINGLE_SPLIT:  # the whole context: out is final, no partial results and no merge
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(partial_lse_ptr + row, lse, mask=head_mask)
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one (sequence, query head)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    lse = tl.load(partial_lse_ptr + row * num_splits + splits, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # all splits empty (no context): every weight is 0 and out is 0
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    partial = tl.load(
        partial_out_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
) -> int:
    """Splits per (sequence, KV head): enough to fill num_sms about twice, but at most
    ceil(max_seq_len / min_keys_per_split) (splits of about min_keys_per_split keys or
    more) and at most MAX_SPLITS."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.cdiv(2 * num_sms, programs)
    longest = max(triton.cdiv(max_seq_len, min_keys_per_split), 1)
    return max(1, min(wanted, longest, MAX_SPLITS))


def _launch_config(block_g: int, block_d: int, itemsize: int, device: torch.device):
    """(BLOCK_N, num_warps, num_stages): 64-key tiles, pipelined as deep as shared memory
    allows (decode is a stream of K/V loads: the pipeline hides their latency). Dots on the
    CUDA cores (`tensor_core_dots` false) hold their operands in registers: 32-key tiles,
    16 for a group of more than 16 heads on 8 warps, which compile without spilling."""
    if INTERPRETED:
        return 32, 4, 1
    if not tensor_core_dots(itemsize, device):
        return (32, 4, 1) if block_g <= 16 else (16, 8, 1)
    for block_n in (64, 32, 16):
        fixed = (block_g * block_d + block_g * block_n) * itemsize
        stages = fit_num_stages(fixed, 2 * block_n * block_d * itemsize, 3, device)
        if stages >= 1:
            return block_n, 4, stages
    return 16, 4, 1


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context.

    q: [num_seqs, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, max_num_blocks] int32; seq_lens: [num_seqs] int32,
    each at most max_seq_len (a host int: it sizes the splits without a device sync);
    num_splits: None picks `choose_num_splits`. Returns [num_seqs, num_heads, head_dim].
    """
    check_dtype("q", q, (torch.float16, torch.bfloat16, torch.float32))
    check_device("q", q)
    if q.dim() != 3 or not 0 < q.shape[2] <= MAX_HEAD_DIM:
        raise ValueError(
            f"q must have shape [num_seqs, num_heads, head_dim] with head_dim <= "
            f"{MAX_HEAD_DIM}, got {list(q.shape)}"
        )
    num_seqs, num_heads, head_dim = q.shape
    check_shape("kv_cache", kv_cache, (2, None, None, None, head_dim))
    num_kv_heads = kv_cache.shape[3]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"kv_cache's num_kv_heads ({num_kv_heads}) must divide q's num_heads ({num_heads})"
        )
    check_dtype("kv_cache", kv_cache, (q.dtype,))
    check_shape("block_tables", block_tables, (num_seqs, None))
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    tensors = {"q": q, "kv_cache": kv_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    for name, t in tensors.items():
        check_same_device(name, t, q)
        check_contiguous(name, t)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, sm_count(q.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")

    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    single = num_splits == 1
    # one split writes out directly; more write float32 partial results for the merge
    partial_shape = (0,) if single else (num_seqs, num_heads, num_splits)
    partial_out = torch.empty(*partial_shape, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    block_g = max(16, triton.next_power_of_2(num_heads // num_kv_heads))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n, num_warps, num_stages = _launch_config(block_g, block_d, q.element_size(), q.device)
    _paged_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        scale * 1.4426950408889634,  # log2(e): base-2 exponentials
        block_tables.stride(0),
        kv_cache.stride(0),  # keys to values
        num_heads,
        num_kv_heads,
        num_splits,
        HEAD_DIM=head_dim,
        CACHE_BLOCK_SIZE=kv_cache.shape[2],
        SINGLE_SPLIT=single,
        DOT_FP32=INTERPRETED or q.dtype == torch.float32,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not single:
        _merge_splits_kernel[(num_seqs * num_heads,)](
            partial_out,
            partial_lse,
            out,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The oracle: per sequence, look up every context token's block and offset, and take
    one float64 softmax over all of it (no splits, no tiles)."""
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        token = torch.arange(seq_len, device=q.device)
        block = block_tables[b].long()[token // block_size]
        keys = kv_cache[0, block, token % block_size].double()  # [seq_len, kv_heads, d]
        values = kv_cache[1, block, token % block_size].double()
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # [seq_len, heads, d]
        values = values.repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,thd->ht", q[b].double(), keys) * scale).softmax(-1)
        out[b] = torch.einsum("ht,thd->hd", probs, values).to(q.dtype)
    return out


def paged_decode_flops(seq_lens: list[int], num_heads: int, head_dim: int) -> int:
    """FLOPs one call does: 4 * head_dim per (query head, context token)."""
    return 4 * head_dim * num_heads * sum(seq_lens)


def paged_decode_bytes(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Compulsory bytes: every context's keys and values once, q read and out written."""
    elements = 2 * num_kv_heads * sum(seq_lens) + 2 * len(seq_lens) * num_heads
    return elements * head_dim * itemsize
