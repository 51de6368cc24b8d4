"""Rotary position embedding (RoPE), with Llama 3's frequency scaling.

RoPE (Su et al., 2021, "RoFormer") encodes position p by rotating each pair of
features (x_i, x_{i + d/2}) of a query or key by the angle p * inv_freq[i], where
inv_freq[i] = theta^(-2i / d). The dot product of a rotated query and key then depends
only on their distance. We pair feature i with feature i + d/2 ("rotate_half"), the
Hugging Face convention, not adjacent features (the "interleaved" GPT-J convention).
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """inv_freq: [head_dim // 2] float32, one rotation frequency (radians per position) per pair.

    With `rope_scaling = {"rope_type": "llama3", ...}` (Llama 3.1) the frequencies are
    rescaled by wavelength 2*pi / inv_freq, relative to the pre-training context
    L = original_max_position_embeddings:
      - wavelength < L / high_freq_factor (high frequencies): unchanged;
      - wavelength > L / low_freq_factor (low frequencies): divided by `factor`;
      - in between: interpolated, inv_freq * ((1 - s) / factor + s) with
        s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    """
    # on the CPU explicitly: a model built under torch.device("meta") still needs real values
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_scaling is None:
        return inv_freq
    if rope_scaling.get("rope_type") != "llama3":
        raise ValueError(f"unsupported rope_scaling {rope_scaling!r}; expected rope_type 'llama3'")
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    original_context = rope_scaling["original_max_position_embeddings"]

    wavelen = 2 * math.pi / inv_freq
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = inv_freq * ((1 - smooth) / factor + smooth)
    scaled = torch.where(
        wavelen > original_context / low_freq_factor, inv_freq / factor, interpolated
    )
    return torch.where(wavelen < original_context / high_freq_factor, inv_freq, scaled)


class RotaryEmbedding:
    """cos/sin tables for the positions of one batch.

    The frequencies stay a plain float32 tensor rather than a module buffer, so that
    `model.to(torch.bfloat16)` cannot round them: at position 100 000 a bf16 frequency
    would be off by hundreds of radians.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None) -> None:
        self.inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [...] int -> cos, sin: [..., head_dim] in `dtype` (angles in float32)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions[..., None].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., num_heads, head_dim]; cos, sin: [..., head_dim] -> x rotated, same shape."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [..., head_dim] -> the tables `apply_rope_tables` takes, [..., 1, head_dim]:
    cos, and sin with its first half negated. Built once per batch, used by every layer."""
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(-2), signed_sin.unsqueeze(-2)


def apply_rope_tables(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` from `rope_tables`, bit for bit, in four operations instead of ten:
    rotate_half(x) * sin = (-x2 * s1, x1 * s2) = roll(x) * (-s1, s2), as negation is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
