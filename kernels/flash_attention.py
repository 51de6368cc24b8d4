"""FlashAttention forward for prefill: causal, GQA, packed variable-length sequences, and a
prefix read from the paged KV cache.

Math. Sequence b contributes q_len new tokens (rows cu_seqlens[b] .. cu_seqlens[b + 1] of q,
k and v) after prefix_len tokens already in the KV cache (0 without a prefix). Its query j
sits at position prefix_len + j and attends to every prefix token and to new tokens 0 .. j:

    out_j = sum_t softmax_t(scale * q_j . k_t) v_t

Query head h reads KV head h // (num_heads / num_kv_heads) (grouped-query attention,
Ainslie et al., 2023). The prefix is what chunked prefill has computed in earlier steps, or
what a prefix-cache hit found: it is read through the block table, key t of sequence b from
block block_tables[b, t // block_size] at offset t % block_size.

Online softmax (Milakov & Gimelshein, 2018; FlashAttention: Dao et al., 2022). A program
keeps, for each of its BLOCK_M query rows, the running maximum m of the scores seen, the
running sum l of exp(score - m) and the unnormalized output acc. A new tile of BLOCK_N
scores s updates them as m' = max(m, max s), l' = l * e^(m - m') + sum e^(s - m'),
acc' = acc * e^(m - m') + e^(s - m') v, and out = acc / l at the end; the [q_len, seq_len]
score matrix never exists in memory. Scores are computed in base 2 (exp2 of s * log2 e).

Tiling: one program per (BLOCK_M query rows, sequence, query head). It walks the prefix in
BLOCK_N-key tiles gathered through the block table, then the new keys up to the diagonal of
its rows (causal: only the tiles on the diagonal are masked, later tiles are skipped). Scores,
softmax statistics and the accumulator are float32; under the interpreter the dots are
float32 too (its bfloat16 dot is wrong), on a GPU they take the inputs' dtype, and float32
inputs use IEEE float32 rather than TF32.

Cost per call, with L_b new and P_b prefix tokens per sequence, h query heads, h_kv KV
heads, head size d, b = itemsize: FLOPs flash_attention_flops(): 4 d h per (query, key)
pair attended (2 for q.k, 2 for p v), sum_b L_b (P_b + (L_b + 1) / 2) pairs; bytes moved
flash_attention_bytes(): the compulsory traffic, each input read once and the output
written once, (2 L h + 2 L h_kv + 2 P h_kv) d b summed over sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels.device
from kernels import INTERPRETED
from kernels.checks import (
    check_contiguous,
    check_device,
    check_dtype,
    check_same_device,
    check_shape,
)

MAX_HEAD_DIM = 256


@triton.jit
def _attend_tile(
    q, k_t, v, mask, m_i, l_i, acc, scale_log2e, MASKED: tl.constexpr, DOT_FP32: tl.constexpr
):
    """One online-softmax step: scores of q [M, D] against k_t [D, N] (where `mask` holds,
    if MASKED), then the running max, sum and accumulator updated with v [N, D]."""
    if DOT_FP32:
        k_t, v = k_t.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, k_t, input_precision="ieee") * scale_log2e
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _load_new_kv(
    k_ptr, v_ptr, q_start, keys, key_mask, kv_head, num_kv_heads, dims, HEAD_DIM: tl.constexpr
):
    """The new tokens' keys (transposed, [D, N]) and values ([N, D]) at `keys`."""
    dim_mask = dims < HEAD_DIM
    kv_offsets = ((q_start + keys).to(tl.int64) * num_kv_heads + kv_head) * HEAD_DIM
    k_t = tl.load(
        k_ptr + kv_offsets[None, :] + dims[:, None],
        mask=key_mask[None, :] & dim_mask[:, None],
        other=0.0,
    )
    v = tl.load(
        v_ptr + kv_offsets[:, None] + dims[None, :],
        mask=key_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    return k_t, v


@triton.jit
def _flash_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    kv_cache_ptr,
    block_tables_ptr,
    prefix_lens_ptr,
    scale_log2e,
    block_tables_stride,
    cache_value_offset,
    num_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // (num_heads // num_kv_heads)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    row_mask = rows < q_len
    q_offsets = ((q_start + rows).to(tl.int64) * num_heads + head)[:, None] * HEAD_DIM
    q = tl.load(
        q_ptr + q_offsets + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, BLOCK_N)

    if HAS_PREFIX:
        # every query row sees the whole prefix: only the tile's end is masked
        prefix_len = tl.load(prefix_lens_ptr + seq)
        for start in range(0, prefix_len, BLOCK_N):
            keys = start + cols
            key_mask = keys < prefix_len
            block = tl.load(
                block_tables_ptr + seq * block_tables_stride + keys // CACHE_BLOCK_SIZE,
                mask=key_mask,
                other=0,
            ).to(tl.int64)
            slot = block * CACHE_BLOCK_SIZE + keys % CACHE_BLOCK_SIZE
            kv_offsets = (slot * num_kv_heads + kv_head) * HEAD_DIM
            load_mask = key_mask[None, :] & dim_mask[:, None]
            k_t = tl.load(
                kv_cache_ptr + kv_offsets[None, :] + dims[:, None], mask=load_mask, other=0.0
            )
            v = tl.load(
                kv_cache_ptr + cache_value_offset + kv_offsets[:, None] + dims[None, :],
                mask=key_mask[:, None] & dim_mask[None, :],
                other=0.0,
            )
            m_i, l_i, acc = _attend_tile(
                q, k_t, v, key_mask[None, :], m_i, l_i, acc, scale_log2e, True, DOT_FP32
            )

    # The new tokens, causally. Keys left of this block's first row are visible to all its
    # rows (BLOCK_M is a multiple of BLOCK_N, so those tiles end there): no mask. The tiles
    # on the diagonal get the causal mask; tiles right of it are never visited.
    diagonal = m_block * BLOCK_M
    for start in range(0, diagonal, BLOCK_N):
        keys = start + cols
        k_t, v = _load_new_kv(
            k_ptr, v_ptr, q_start, keys, keys < q_len, kv_head, num_kv_heads, dims, HEAD_DIM
        )
        m_i, l_i, acc = _attend_tile(q, k_t, v, 0, m_i, l_i, acc, scale_log2e, False, DOT_FP32)
    for start in range(diagonal, tl.minimum(q_len, diagonal + BLOCK_M), BLOCK_N):
        keys = start + cols
        key_mask = keys < q_len
        k_t, v = _load_new_kv(
            k_ptr, v_ptr, q_start, keys, key_mask, kv_head, num_kv_heads, dims, HEAD_DIM
        )
        causal = (keys[None, :] <= rows[:, None]) & key_mask[None, :]
        m_i, l_i, acc = _attend_tile(q, k_t, v, causal, m_i, l_i, acc, scale_log2e, True, DOT_FP32)

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_offsets + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def tile_shared_bytes(
    block_m: int, block_n: int, head_dim: int, itemsize: int, stages: int, q_in_shared: bool
) -> int:
    """Shared memory of one program's tiles: `stages` pipelined copies of a K tile and a V
    tile, plus the q tile where the tensor-core instruction reads it from shared memory
    (Hopper's wgmma; mma.sync reads it from registers). The score tile never goes there: it
    is the accumulator of the first dot, in registers."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return (q_in_shared * block_m * block_d + stages * 2 * block_n * block_d) * itemsize


def tile_config(
    head_dim: int,
    itemsize: int,
    shared_memory_bytes: int,
    compute_capability: tuple[int, int] | None,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) on a GPU of this compute capability (None:
    unknown, budgeted like Hopper) that gives one program `shared_memory_bytes`.

    With tensor cores (16-bit inputs on Ampere or later): the largest tiles whose q tile
    (Hopper) and at least one stage of K/V tiles fit, pipelined up to 3 stages deep.
    Without them (float32 inputs, which ask for IEEE dots, and Turing, for which Triton
    compiles dots to FMA instructions) the operands and the accumulators all live in
    registers: 32 x 32 tiles over 8 warps compile without spilling for head_dim <= 128.
    BLOCK_M is a multiple of BLOCK_N: the unmasked tiles must end where a block of rows
    begins."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if itemsize == 4 or (compute_capability is not None and compute_capability < (8, 0)):
        return (32, 32, 8, 1) if block_d <= 128 else (16, 16, 4, 1)
    q_in_shared = compute_capability is None or compute_capability >= (9, 0)
    for block_m, block_n in ((128, 64), (64, 64), (64, 32), (32, 32)):
        fixed = tile_shared_bytes(block_m, block_n, head_dim, itemsize, 0, q_in_shared)
        per_stage = tile_shared_bytes(block_m, block_n, head_dim, itemsize, 1, False)
        stages = min(3, (shared_memory_bytes - fixed) // per_stage)
        if stages >= 1:
            return block_m, block_n, 8 if block_m * block_d >= 128 * 128 else 4, stages
    return 16, 16, 4, 1


def _launch_config(head_dim: int, itemsize: int, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Under the interpreter each program step is
    a NumPy call, so fewer, larger tiles are faster; 32 keeps test shapes multi-tile."""
    if INTERPRETED:
        return 32, 32, 4, 1
    return tile_config(
        head_dim,
        itemsize,
        kernels.device.max_shared_memory_bytes(device),
        kernels.device.compute_capability(device),
    )


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    kv_cache: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences over their prefix in the cache and themselves.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (the new
    tokens); cu_seqlens: [num_seqs + 1] int32, sequence b is rows cu_seqlens[b] ..
    cu_seqlens[b + 1]; max_seqlen: the longest sequence's new tokens (a host int, so that
    the launch needs no device sync); scale: usually head_dim ** -0.5.
    With a prefix, all three of kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim] (keys, values), block_tables: [num_seqs, max_num_blocks] int32 and
    prefix_lens: [num_seqs] int32 (tokens of each sequence already in the cache).
    Returns [num_tokens, num_heads, head_dim] like q.
    """
    check_dtype("q", q, (torch.float16, torch.bfloat16, torch.float32))
    check_device("q", q)
    if q.dim() != 3 or not 0 < q.shape[2] <= MAX_HEAD_DIM:
        raise ValueError(
            f"q must have shape [num_tokens, num_heads, head_dim] with head_dim <= "
            f"{MAX_HEAD_DIM}, got {list(q.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    check_shape("k", k, (num_tokens, None, head_dim))
    num_kv_heads = k.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"k's num_kv_heads ({num_kv_heads}) must divide q's num_heads ({num_heads})"
        )
    check_shape("v", v, tuple(k.shape))
    check_shape("cu_seqlens", cu_seqlens, (None,))
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens must have num_seqs + 1 >= 1 entries, got 0")
    check_dtype("cu_seqlens", cu_seqlens, (torch.int32,))
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens}
    has_prefix = kv_cache is not None or block_tables is not None or prefix_lens is not None
    if has_prefix:
        if kv_cache is None or block_tables is None or prefix_lens is None:
            raise ValueError("a prefix needs all of kv_cache, block_tables and prefix_lens")
        check_shape("kv_cache", kv_cache, (2, None, None, num_kv_heads, head_dim))
        check_shape("block_tables", block_tables, (num_seqs, None))
        check_dtype("block_tables", block_tables, (torch.int32,))
        check_shape("prefix_lens", prefix_lens, (num_seqs,))
        check_dtype("prefix_lens", prefix_lens, (torch.int32,))
        tensors |= {"kv_cache": kv_cache, "block_tables": block_tables, "prefix_lens": prefix_lens}
    for name in ("k", "v") + (("kv_cache",) if has_prefix else ()):
        check_dtype(name, tensors[name], (q.dtype,))
    for name, t in tensors.items():
        check_same_device(name, t, q)
        check_contiguous(name, t)

    if cu_seqlens.device.type == "cpu" and num_seqs:  # free to check here; on a GPU, a sync
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if longest > max_seqlen:
            raise ValueError(
                f"max_seqlen ({max_seqlen}) is less than the longest sequence ({longest}): its "
                "rows past max_seqlen would never be computed"
            )
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0 or max_seqlen <= 0:
        return out
    block_m, block_n, num_warps, num_stages = _launch_config(head_dim, q.element_size(), q.device)
    grid = (triton.cdiv(max_seqlen, block_m), num_seqs, num_heads)
    _flash_attention_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        kv_cache if has_prefix else q,  # unused without HAS_PREFIX
        block_tables if has_prefix else cu_seqlens,
        prefix_lens if has_prefix else cu_seqlens,
        scale * 1.4426950408889634,  # log2(e): the kernel exponentiates in base 2
        block_tables.stride(0) if has_prefix else 0,
        kv_cache.stride(0) if has_prefix else 0,  # keys to values
        num_heads,
        num_kv_heads,
        HEAD_DIM=head_dim,
        CACHE_BLOCK_SIZE=kv_cache.shape[2] if has_prefix else 1,
        HAS_PREFIX=has_prefix,
        DOT_FP32=INTERPRETED or q.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    kv_cache: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: per sequence, look up each prefix token's block and offset, append the
    new keys and values, and take a masked softmax over the full float64 score matrix."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        keys, values = k[start:end].double(), v[start:end].double()
        prefix_len = 0 if prefix_lens is None else int(prefix_lens[b])
        if prefix_len:
            block_size = kv_cache.shape[2]
            token = torch.arange(prefix_len, device=q.device)
            block = block_tables[b].long()[token // block_size]
            prefix = kv_cache[:, block, token % block_size].double()  # [2, prefix, kv_heads, d]
            keys, values = torch.cat((prefix[0], keys)), torch.cat((prefix[1], values))
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * scale
        query_pos = prefix_len + torch.arange(end - start, device=q.device)
        key_pos = torch.arange(keys.shape[0], device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def attended_pairs(q_len: int, prefix_len: int) -> int:
    """(query, key) pairs causal attention computes for one sequence."""
    return q_len * prefix_len + q_len * (q_len + 1) // 2


def flash_attention_flops(
    q_lens: list[int], prefix_lens: list[int], num_heads: int, head_dim: int
) -> int:
    """FLOPs one call does: 4 * head_dim per attended (query, key) pair and query head."""
    pairs = sum(attended_pairs(n, p) for n, p in zip(q_lens, prefix_lens, strict=True))
    return 4 * head_dim * num_heads * pairs


def flash_attention_bytes(
    q_lens: list[int],
    prefix_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
) -> int:
    """Compulsory bytes: q, k, v and the prefix's keys and values read once, out written."""
    new, prefix = sum(q_lens), sum(prefix_lens)
    elements = 2 * new * num_heads + 2 * new * num_kv_heads + 2 * prefix * num_kv_heads
    return elements * head_dim * itemsize


def unfused_attention_bytes(
    q_len: int, kv_len: int, num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Bytes one sequence's attention moves as three kernels that store the score matrix.

    S = scale q k^T is written ([num_heads, q_len, kv_len] at itemsize), softmax reads S and
    writes P, and P v reads P: four passes over the matrix FlashAttention never stores,
    added to the compulsory traffic (q, k and v read once, out written once).
    """
    matrix = num_heads * q_len * kv_len * itemsize
    compulsory = (2 * q_len * num_heads + 2 * kv_len * num_kv_heads) * head_dim * itemsize
    return 4 * matrix + compulsory
