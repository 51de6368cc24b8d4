"""Integer grids for weights, and round-to-nearest (RTN): the baseline way to pick the codes.

A weight matrix W: [N, K] (N output channels, K input channels) is cut into groups of
`group_size` consecutive input channels per output channel (one group per row when
group_size is None: "per channel"). Each group gets an affine grid

    w ~ s * (q - z),   q an integer code in [q_min, q_max],

with a float scale s and an integer zero point z. Two choices of grid:

- symmetric (int8 here): z = 0, q in [-127, 127], s = max|w| / 127. Zero is exact, the grid
  is centered on zero, and a kernel needs no zero point: W8A16's scale factors out of the
  dot product.
- asymmetric (int4 here): q in [0, 15], the grid spans the group's [min, max] (widened to
  include 0, as GPTQ does, so that zero stays representable): s = (max - min) / 15,
  z = round(-min / s). A symmetric grid spans [-max|w|, max|w|]; when a group's weights are
  not centered on zero, part of that span holds no weight, and with only 16 levels every
  wasted level counts. The zero point costs one small integer per group (1/128 of a byte
  per weight at group size 128). GPTQ and AWQ checkpoints use it for the same reason.

Scales are rounded to float16 values (and kept at least float16's smallest normal 2^-14),
then to the dtype the layer keeps them in: GPTQ and AWQ checkpoints store float16 scales, so
a model quantized here is written and read back bit for bit, and the codes are chosen for the
scales the layer really multiplies by.

RTN then picks q = clamp(round(w / s) + z): the nearest code, each weight alone. Its error
is at most s / 2 per weight inside the grid. GPTQ and AWQ keep this grid (AWQ on rescaled
weights) and choose the codes better.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SCALE = 2.0**-14  # float16's smallest normal: every scale is a normal float16 value


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How a weight is quantized: `bits` per code, groups of `group_size` input channels
    (None: one group per output channel), symmetric (no zero point) or not."""

    bits: int
    group_size: int | None
    symmetric: bool

    @property
    def q_min(self) -> int:
        return -(2 ** (self.bits - 1) - 1) if self.symmetric else 0

    @property
    def q_max(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

    def group_size_for(self, in_features: int) -> int:
        size = in_features if self.group_size is None else self.group_size
        if in_features % size:
            raise ValueError(
                f"group_size {size} does not divide the layer's input dim {in_features}"
            )
        return size


INT8_PER_CHANNEL = QuantSpec(bits=8, group_size=None, symmetric=True)


def int4_spec(group_size: int) -> QuantSpec:
    """4-bit codes with a zero point, one scale per `group_size` input channels."""
    return QuantSpec(bits=4, group_size=group_size, symmetric=False)


def find_grid(
    w: torch.Tensor, spec: QuantSpec, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (scales, zeros), each [N, K / group_size] float32 (zeros are integers,
    all 0 for a symmetric grid); the scales are values of float16 and of `dtype`, the dtype
    they will be stored in."""
    n, k = w.shape
    size = spec.group_size_for(k)
    groups = w.detach().float().reshape(n, k // size, size)
    if spec.symmetric:
        scales = groups.abs().amax(dim=2) / spec.q_max
    else:
        low = groups.amin(dim=2).clamp(max=0.0)
        high = groups.amax(dim=2).clamp(min=0.0)
        scales = (high - low) / spec.q_max
    scales = scales.clamp(min=MIN_SCALE).half().to(dtype).float()
    if spec.symmetric:
        return scales, torch.zeros_like(scales)
    zeros = (-low / scales).round().clamp(spec.q_min, spec.q_max)
    return scales, zeros


def round_to_grid(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: QuantSpec
) -> torch.Tensor:
    """The nearest code of each weight: clamp(round(w / s) + z, q_min, q_max), int32.
    `scales` and `zeros` broadcast against w (one value per element)."""
    w = w if w.dtype == torch.float64 else w.float()
    q = torch.round(w / scales) + zeros
    return q.clamp(spec.q_min, spec.q_max).to(torch.int32)


def expand_groups(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, G] per-group values -> [N, G * group_size] per-weight values."""
    return t.repeat_interleave(group_size, dim=1)


def quantize(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: QuantSpec
) -> torch.Tensor:
    """w: [N, K] -> codes [N, K] int32 on the given per-group grid."""
    size = spec.group_size_for(w.shape[1])
    return round_to_grid(w, expand_groups(scales, size), expand_groups(zeros, size), spec)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """codes [N, K] and per-group [N, G] scales and zeros -> s * (q - z): [N, K] float32."""
    size = q.shape[1] // scales.shape[1]
    return (q.float() - expand_groups(zeros.float(), size)) * expand_groups(scales.float(), size)


def rtn(
    w: torch.Tensor, spec: QuantSpec, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: w [N, K] -> (codes [N, K] int32, scales [N, G], zeros [N, G]),
    scales to be stored in `dtype`."""
    scales, zeros = find_grid(w, spec, dtype)
    return quantize(w, scales, zeros, spec), scales, zeros
