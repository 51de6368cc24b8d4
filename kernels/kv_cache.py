"""The KV-cache store: each new token's key and value into its slot of the paged cache.

Math: for token i with slot s = slot_mapping[i] >= 0, kv_cache[0, s // block_size,
s % block_size] = k[i] and kv_cache[1, ...] = v[i] (vLLM calls this `reshape_and_cache`).
A negative slot means "no slot": the token is padding (a CUDA graph replays a batch padded
up to its captured size) and is skipped, which `index_copy_` could not do.

Tiling: one program per token copies its [num_kv_heads * head_dim] key row and value row.

Cost per call (t tokens, b = itemsize): bytes moved kv_cache_write_bytes(): the keys and
values read and written, 4 t h_kv d b, plus the slot ids; no FLOPs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import (
    check_contiguous,
    check_device,
    check_dtype,
    check_same_device,
    check_shape,
)


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    cache_value_offset,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding
        return
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(k_ptr + token * ROW + cols, mask=mask)
    v = tl.load(v_ptr + token * ROW + cols, mask=mask)
    tl.store(kv_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(kv_cache_ptr + cache_value_offset + slot * ROW + cols, v, mask=mask)


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_dim] of k's dtype, written in place; slot_mapping: [num_tokens] int64,
    negative for tokens to skip."""
    check_dtype("kv_cache", kv_cache, (torch.float16, torch.bfloat16, torch.float32))
    check_device("kv_cache", kv_cache)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {list(kv_cache.shape)}"
        )
    num_kv_heads, head_dim = kv_cache.shape[3:]
    check_shape("k", k, (None, num_kv_heads, head_dim))
    check_shape("v", v, tuple(k.shape))
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    for name, t in (("k", k), ("v", v)):
        check_dtype(name, t, (kv_cache.dtype,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    for name, t in (("k", k), ("v", v), ("slot_mapping", slot_mapping), ("kv_cache", kv_cache)):
        check_same_device(name, t, kv_cache)
        check_contiguous(name, t)
    if k.shape[0] == 0:
        return
    row = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(k.shape[0],)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_cache.stride(0),  # keys to values
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        num_warps=4,
    )


def reshape_and_cache_reference(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The oracle: token by token, block and offset from the slot, padding skipped."""
    block_size = kv_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            kv_cache[0, slot // block_size, slot % block_size] = k[i]
            kv_cache[1, slot // block_size, slot % block_size] = v[i]


def kv_cache_write_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes one call moves: keys and values read and written, 8-byte slot ids read."""
    return 4 * num_tokens * num_kv_heads * head_dim * itemsize + 8 * num_tokens
