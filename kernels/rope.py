"""Rotary position embedding (RoPE) of q and k at per-token positions.

Math (Su et al., 2021, "RoFormer"), Hugging Face's "rotate_half" pairing: for a head vector
x of size d and a token at position p, feature i < d/2 pairs with feature i + d/2 and the
pair turns by the angle p * inv_freq[i]:

    out[i]       = x[i] * cos(p * inv_freq[i]) - x[i + d/2] * sin(p * inv_freq[i])
    out[i + d/2] = x[i + d/2] * cos(p * inv_freq[i]) + x[i] * sin(p * inv_freq[i])

The frequencies `inv_freq` come in as an argument: the model computes them from its
rope_theta and rope_scaling (Llama 3's included; `minillm.model.rope.rope_inv_freq`), so this
package needs nothing of the model's configuration. `rope_cos_sin_cache` tabulates cos
and sin once per model for every position up to max_position_embeddings, in float32 (the
angles of distant positions need float32; vLLM keeps the same `cos_sin_cache`), and the
kernel looks up each token's row by its position. The kernel rotates in float32 and rounds
once, to q's dtype.

Tiling: one program per token rotates all heads of q and of k: it reads the token's cos/sin
row once and the heads as a [heads, d/2] tile per half.

Cost per call (t tokens, h + h_kv heads of size d, b = itemsize): bytes moved rope_bytes():
q and k read and written, 2 * t * (h + h_kv) * d * b, plus t * d * 4 for the cos/sin rows;
FLOPs rope_flops(): 3 per element (two products, one sum).
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


def rope_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """cos_sin_cache: [max_position, head_dim] float32 from the [head_dim / 2] frequencies;
    row p is cos(p * inv_freq) followed by sin(p * inv_freq), head_dim / 2 values each."""
    inv_freq = inv_freq.detach().to("cpu", torch.float32)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


@triton.jit
def _rotate_heads(
    in_ptr,
    out_ptr,
    token,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate the num_heads head vectors of one token, BLOCK_H heads at a time."""
    cols = tl.arange(0, BLOCK_HALF)
    for head_start in range(0, num_heads, BLOCK_H):
        heads = head_start + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]
        offsets = (token * num_heads + heads)[:, None] * (2 * HALF) + cols[None, :]
        x1 = tl.load(in_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(in_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + offsets, out1.to(dtype), mask=mask)
        tl.store(out_ptr + offsets + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * (2 * HALF)
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, token, num_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, num_kv_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [..., num_heads, head_dim]; k: [..., num_kv_heads, head_dim]; positions: [...] int
    (the leading dims of q, or broadcastable to them); cos_sin_cache: [max_position, head_dim]
    float32 from `rope_cos_sin_cache` -> rotated (q, k), new tensors like q and k.

    Positions must lie in [0, max_position); they are device values and are not checked.
    """
    check_dtype("q", q, (torch.float16, torch.bfloat16, torch.float32))
    check_device("q", q)
    if q.dim() < 2 or q.shape[-1] % 2 or q.shape[-1] < 2:
        raise ValueError(
            f"q must have shape [..., num_heads, head_dim] with an even head_dim, got "
            f"{list(q.shape)}"
        )
    lead, head_dim = q.shape[:-2], q.shape[-1]
    check_shape("k", k, (*lead, None, head_dim))
    check_dtype("k", k, (q.dtype,))
    check_dtype("positions", positions, (torch.int32, torch.int64))
    check_shape("cos_sin_cache", cos_sin_cache, (None, head_dim))
    check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    for name, t in (("k", k), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        check_same_device(name, t, q)
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_contiguous(name, t)
    try:
        positions = positions.expand(lead).contiguous()
    except RuntimeError:
        raise ValueError(
            f"positions must broadcast to q's leading dims {list(lead)}, "
            f"got {list(positions.shape)}"
        ) from None

    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    num_tokens = positions.numel()
    if num_tokens > 0:
        num_heads, num_kv_heads = q.shape[-2], k.shape[-2]
        block_half = triton.next_power_of_2(head_dim // 2)
        # a [heads, head_dim / 2] tile of about 4096 elements per step
        block_h = min(
            triton.next_power_of_2(max(num_heads, num_kv_heads)), max(4096 // block_half, 1)
        )
        _rope_kernel[(num_tokens,)](
            q,
            k,
            q_out,
            k_out,
            positions,
            cos_sin_cache,
            num_heads,
            num_kv_heads,
            HALF=head_dim // 2,
            BLOCK_H=block_h,
            BLOCK_HALF=block_half,
            num_warps=4,
        )
    return q_out, k_out


def apply_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: rotate each (x_i, x_{i + d/2}) pair as a complex number by e^{i p w_i}, in
    float64, with the model's frequencies w = inv_freq. The angles p * w_i are float32
    products, as the model computes them (the convention being checked, not the trigonometry)."""
    head_dim = 2 * inv_freq.numel()
    inv_freq = inv_freq.to(q.device, torch.float32)
    angles = (positions.float()[..., None] * inv_freq).double()  # [..., d/2]
    rotation = torch.polar(torch.ones_like(angles), angles)[..., None, :]  # one per head

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x64 = x.double()
        pairs = torch.complex(x64[..., : head_dim // 2], x64[..., head_dim // 2 :]) * rotation
        return torch.cat((pairs.real, pairs.imag), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rope_bytes(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Bytes one call moves: q and k in and out, one float32 cos/sin row per token."""
    return (
        2 * num_tokens * (num_heads + num_kv_heads) * head_dim * itemsize
        + num_tokens * head_dim * 4
    )


def rope_flops(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """FLOPs one call does: two products and a sum per output element."""
    return 3 * num_tokens * (num_heads + num_kv_heads) * head_dim
