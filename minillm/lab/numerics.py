"""Numerics of quantized inference: formats, block scales, bytes and where 4 bits pay.

What chapter 6 computes with. Everything here follows from a definition, never from a
typed-in constant:

- Floating formats come from their bit layouts (`minillm.model.quantization.formats`:
  exponent bits, mantissa bits, bias, and what the all-ones exponent field holds). This
  module adds the spacing of a format near 1 (the gap just above 1 is machine epsilon
  2^-m, the gap just below is half of it) and rounding to any small format by enumerating
  its codes, so FP4 rounds exactly the way FP8 does in PyTorch.
- Block formats (OCP Microscaling v1.0 and NVIDIA's NVFP4) store FP4 E2M1 elements with one
  scale per block: MXFP4 a power of two (E8M0: 8 exponent bits, bias 127, no mantissa, no
  sign, 0xFF is NaN) per 32 elements, NVFP4 an FP8 E4M3 scale per 16 elements and one
  float32 scale per tensor. Their bits per element count the scales.
- Integer grids: fake quantization per tensor, per channel or per group (`fake_quantize`),
  the weight bytes of a quantized model with its scales and zero points
  (`quantized_model_bytes`), and SmoothQuant's per-channel migration of activation range
  into the weights (`smoothquant_scales`).
- The roofline of one linear layer in 16 bits, weight-only 4 bits (W4A16) and 8-bit
  weights and activations (W8A8), and the batches at which W4A16 stops paying
  (`w4a16_batches`), from chapter 2's model with chapter 5's byte count.
- Batch (non-)invariance: `row_in_batch_differs` compares one row's matmul alone and inside
  a batch, bit for bit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kernels.quant_matmul import quant_matmul_bytes
from minillm.lab.hardware import DeviceSpec
from minillm.lab.roofline import gemm_bytes, num_params
from minillm.model.config import ModelConfig
from minillm.model.quantization.formats import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    FloatFormat,
)

FLOAT_FORMATS: dict[str, FloatFormat] = {
    f.name: f for f in (FLOAT32, BFLOAT16, FLOAT16, FP8_E4M3, FP8_E5M2, FP4_E2M1)
}
E8M0_BIAS = 127  # OCP MX v1.0, section 5.4: the shared scale X = 2^(E - 127), E in 0..254


def spacing_near_one(fmt: FloatFormat) -> tuple[float, float]:
    """(gap just below 1, gap just above 1): 2^-(m+1) and 2^-m, from the mantissa bits."""
    return 2.0 ** -(fmt.mantissa_bits + 1), 2.0**-fmt.mantissa_bits


def format_row(fmt: FloatFormat) -> dict:
    """One format's layout and what follows from it."""
    below, above = spacing_near_one(fmt)
    return {
        "format": fmt.name,
        "bits": fmt.bits,
        "exponent_bits": fmt.exponent_bits,
        "mantissa_bits": fmt.mantissa_bits,
        "bias": fmt.bias,
        "max": fmt.max,
        "min_normal": fmt.min_normal,
        "min_subnormal": fmt.min_subnormal,
        "unit_roundoff": fmt.unit_roundoff,
        "gap_below_1": below,
        "gap_above_1": above,
        "infinities": fmt.special == "ieee",
        "nan": fmt.special != "finite",
    }


@functools.cache
def rounding_table(fmt: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(values ascending, whether each value's code is even) for a format of <= 16 bits:
    every finite value once, +0 for both zeros. Cached: do not modify the tensors."""
    if fmt.bits > 16:
        raise ValueError(f"{fmt.name} has 2^{fmt.bits} codes; enumerate 16 bits or fewer")
    best: dict[float, int] = {}
    for code in range(2**fmt.bits):
        v = fmt.decode(code)
        if math.isfinite(v):
            v = v + 0.0  # -0.0 and 0.0 are one value
            mantissa = code & (2**fmt.mantissa_bits - 1)
            best.setdefault(v, mantissa)
    values = sorted(best)
    even = [best[v] % 2 == 0 for v in values]
    return torch.tensor(values, dtype=torch.float64), torch.tensor(even)


def round_to_format(x: torch.Tensor, fmt: FloatFormat, saturate: bool = True) -> torch.Tensor:
    """x rounded to the nearest value of `fmt` (ties to the even mantissa), float64.

    saturate=True clips beyond the largest finite value (what quantizers and vLLM's FP8
    conversions do); False returns inf there (ieee formats) or raises (others).
    """
    values, even = rounding_table(fmt)
    x64 = x.detach().to(torch.float64)
    if not torch.isfinite(x64).all():
        raise ValueError("x must be finite")
    top = float(values[-1])
    if not saturate and (x64.abs() > top).any():
        if fmt.special != "ieee":
            raise ValueError(f"{fmt.name} has no infinity: values beyond {top} need saturate=True")
    clipped = x64.clamp(-top, top)
    hi = torch.searchsorted(values, clipped).clamp(1, len(values) - 1)
    lo = hi - 1
    v_lo, v_hi = values[lo], values[hi]
    d_lo, d_hi = clipped - v_lo, v_hi - clipped
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even[hi])
    out = torch.where(pick_hi, v_hi, v_lo)
    if not saturate and fmt.special == "ieee":
        # beyond max + half a gap, round to nearest gives infinity
        half_gap = 2.0 ** (2**fmt.exponent_bits - 2 - fmt.bias - fmt.mantissa_bits - 1)
        over = x64.abs() >= top + half_gap
        out = torch.where(over, torch.sign(x64) * math.inf, out)
    return out.to(x.dtype) if x.dtype == torch.float64 else out


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """FP4 E2M1 elements with one scale per `block_size` of them.

    scale "e8m0": a power of two 2^(E - 127) (MXFP4); "e4m3": an FP8 E4M3 value times one
    float32 scale per tensor (NVFP4).
    """

    name: str
    block_size: int
    scale: str  # "e8m0" | "e4m3"
    element: FloatFormat = FP4_E2M1

    @property
    def scale_bits(self) -> int:
        return 8

    @property
    def bits_per_element(self) -> float:
        """Element bits plus the block scale's share (the per-tensor scale is negligible)."""
        return self.element.bits + self.scale_bits / self.block_size

    @property
    def scale_range(self) -> tuple[float, float]:
        """(smallest, largest) positive block scale."""
        if self.scale == "e8m0":
            return 2.0**-E8M0_BIAS, 2.0 ** (254 - E8M0_BIAS)
        return FP8_E4M3.min_subnormal, FP8_E4M3.max

    @property
    def max_in_block_units(self) -> float:
        """The largest magnitude a block holds relative to the per-tensor scale."""
        return self.element.max * self.scale_range[1]


MXFP4 = BlockFormat("MXFP4", 32, "e8m0")
NVFP4 = BlockFormat("NVFP4", 16, "e4m3")


def block_quantize(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Quantize x: [..., K] (K a multiple of the block size) to `fmt` and back, float32.

    MXFP4 (OCP MX v1.0, section 6.3): X = 2^(floor(log2 amax) - emax_elem), emax_elem = 2 for
    E2M1, elements round(x / X) to E2M1 saturating at 6 (the largest value of a block may
    clip, by design of the spec). NVFP4: a per-tensor float32 scale amax / (6 * 448) so that
    block scales fit E4M3, then each block scale amax_block / 6 rounded to E4M3.
    """
    k = x.shape[-1]
    if k % fmt.block_size:
        raise ValueError(f"last dim {k} is not a multiple of the block size {fmt.block_size}")
    blocks = x.detach().float().reshape(-1, k // fmt.block_size, fmt.block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if fmt.scale == "e8m0":
        emax_elem = math.floor(math.log2(fmt.element.max))  # 2 for E2M1
        exp = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - emax_elem
        scales = torch.exp2(exp.clamp(-E8M0_BIAS, 254 - E8M0_BIAS))
        tensor_scale = 1.0
    else:
        tensor_amax = float(amax.max())
        tensor_scale = tensor_amax / (fmt.element.max * FP8_E4M3.max) if tensor_amax else 1.0
        raw = amax / fmt.element.max / tensor_scale
        scales = round_to_format(raw, FP8_E4M3).float()
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    elements = round_to_format(blocks / (scales * tensor_scale), fmt.element).float()
    return (elements * scales * tensor_scale).reshape(x.shape)


# -- integer grids -------------------------------------------------------------------------


def fake_quantize(
    w: torch.Tensor, bits: int, granularity: str, group_size: int = 128
) -> torch.Tensor:
    """Symmetric integer round trip of w: [N, K]: s * clamp(round(w / s), -q, q), q = 2^(b-1)-1,
    s = amax / q over the whole tensor ("tensor"), each row ("channel") or each run of
    `group_size` inputs in a row ("group"). Returns float32 [N, K]."""
    if w.dim() != 2:
        raise ValueError(f"w must be [N, K], got {list(w.shape)}")
    if granularity not in ("tensor", "channel", "group"):
        raise ValueError(f"granularity must be tensor, channel or group, got {granularity!r}")
    q_max = 2 ** (bits - 1) - 1
    n, k = w.shape
    size = {"tensor": k, "channel": k, "group": group_size}[granularity]
    if k % size:
        raise ValueError(f"group_size {size} does not divide K = {k}")
    groups = w.detach().float().reshape(n, k // size, size)
    if granularity == "tensor":
        amax = groups.abs().amax().expand(n, k // size, 1)
    else:
        amax = groups.abs().amax(dim=2, keepdim=True)
    s = (amax / q_max).clamp(min=torch.finfo(torch.float32).tiny)
    return (torch.round(groups / s).clamp(-q_max, q_max) * s).reshape(n, k)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius)."""
    return float((approx.float() - exact.float()).norm() / exact.float().norm())


def outlier_ratio(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """amax(|x|) / rms(x), over everything or along `dim`: how many typical magnitudes the
    largest value is. A per-tensor int8 scale spends 127 codes up to the amax, so values of
    typical size get about 127 / ratio of them."""
    x = x.detach().float()
    if dim is None:
        return x.abs().amax() / x.pow(2).mean().sqrt()
    return x.abs().amax(dim=dim) / x.pow(2).mean(dim=dim).sqrt()


def smoothquant_scales(
    act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """SmoothQuant's per-input-channel s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (Xiao et
    al., 2023): X / s and W diag(s) compute the same layer, and alpha moves range from the
    activations to the weights. act_amax, weight_amax: [K]."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    a = act_amax.float().clamp(min=1e-5)
    w = weight_amax.float().clamp(min=1e-5)
    return a.pow(alpha) / w.pow(1 - alpha)


def w8a8_output_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None = None) -> float:
    """Relative output error of a W8A8 layer: activations int8 per token (row), weights int8
    per output channel, after dividing x's columns by s and multiplying W's by s."""
    exact = x.float() @ w.float().T
    if s is not None:
        x, w = x.float() / s, w.float() * s
    xq = fake_quantize(x.float(), 8, "channel")  # one scale per token
    wq = fake_quantize(w.float(), 8, "channel")  # one scale per output channel
    return relative_error(xq @ wq.T, exact)


class _Captured(Exception):
    """Raised by `linear_inputs`' hook: the input is recorded, the rest of the forward is
    not needed."""


@torch.no_grad()
def linear_inputs(model: torch.nn.Module, module: torch.nn.Module, token_ids: torch.Tensor):
    """The input of `module` (a layer of `model`) when `model.forward_causal` runs on
    token_ids [B, T]: [B, T, K]. The forward stops as soon as the module is reached, so the
    layers after it and the LM head cost nothing."""
    seen = []

    def record(_module, inputs):
        seen.append(inputs[0].detach().clone())
        raise _Captured

    handle = module.register_forward_pre_hook(record)
    try:
        model.forward_causal(token_ids)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen:
        raise ValueError("the module was not reached by the model's forward")
    return seen[0]


def engine_w8a8_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None = None) -> float:
    """Relative output error of the engine's `W8A8Linear` for weights w [N, K] on inputs
    x [T, K], built as `quantize_model` builds it: W diag(s) rounded to int8 per output
    channel, and the layer dividing its input by s (SmoothQuant's factors; None: no
    smoothing) before quantizing it per token."""
    from minillm.model.quantization.linear import W8A8Linear
    from minillm.model.quantization.rtn import INT8_PER_CHANNEL, rtn

    w = w.detach().float()
    codes, scales, _ = rtn(w if s is None else w * s, INT8_PER_CHANNEL)
    layer = W8A8Linear(codes, scales, None, torch.float32, s)
    with torch.no_grad():
        return relative_error(layer(x.detach().float()), x.detach().float() @ w.T)


# -- bytes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuantizedBytes:
    """The bytes of a model whose decoder linears are quantized, by what they hold."""

    codes: float
    scales: float
    zeros: float
    unquantized: float  # embeddings, LM head, norms (and biases) in `float_bytes` each

    @property
    def total(self) -> float:
        return self.codes + self.scales + self.zeros + self.unquantized


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out_features N, in_features K) of the seven linears of one decoder layer."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = (
        config.num_attention_heads * d,
        config.num_key_value_heads * d,
        config.intermediate_size,
    )
    return [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]


def quantized_model_bytes(
    config: ModelConfig,
    weight_bits: float,
    group_size: int | None = 128,
    scale_bytes: float = 2,
    zero_bytes: float = 0,
    float_bytes: float = 2,
) -> QuantizedBytes:
    """Bytes of `config` with every decoder linear quantized to `weight_bits` per weight, one
    scale (and, if zero_bytes > 0, one zero point) per `group_size` inputs of each output
    channel (None: per channel), the rest of the parameters in `float_bytes`."""
    codes = scales = 0.0
    linear_params = 0
    for n, k in linear_shapes(config):
        groups = 1 if group_size is None else k // group_size
        if group_size is not None and k % group_size:
            raise ValueError(f"group_size {group_size} does not divide K = {k}")
        codes += n * k * weight_bits / 8
        scales += n * groups
        linear_params += n * k
    layers = config.num_hidden_layers
    rest = num_params(config) - layers * linear_params
    return QuantizedBytes(
        codes=layers * codes,
        scales=layers * scales * scale_bytes,
        zeros=layers * scales * zero_bytes,
        unquantized=rest * float_bytes,
    )


# -- the roofline of one linear layer --------------------------------------------------------


def linear_floor_s(
    m: int, n: int, k: int, device: DeviceSpec, scheme: str = "w16a16", group_size: int = 128
) -> float:
    """The roofline floor max(FLOPs / peak, bytes / bandwidth) of x [m, k] @ W^T [k, n].

    "w16a16": bfloat16 weights and activations on the bfloat16 peak; "w4a16": 4-bit weights
    with 16-bit scales per group (chapter 5's kernel's bytes), the bfloat16 peak (the math
    is 16-bit); "w8a8": int8 weights and activations on the int8 peak.
    Unpacking costs, which a real kernel pays in instructions, are left out.
    """
    flops = 2 * m * n * k
    bw = device.memory_bandwidth_bytes_per_s
    if scheme == "w16a16":
        return max(flops / device.peak_flops("bfloat16"), gemm_bytes(m, k, n, 2) / bw)
    if scheme == "w4a16":
        num_bytes = quant_matmul_bytes(m, n, k, 2, 4, group_size)
        return max(flops / device.peak_flops("bfloat16"), num_bytes / bw)
    if scheme == "w8a8":
        num_bytes = m * k + n * k + 2 * m * n + 4 * (m + n)  # int8 in, bf16 out, fp32 scales
        return max(flops / device.peak_flops("int8"), num_bytes / bw)
    raise ValueError(f"scheme must be w16a16, w4a16 or w8a8, got {scheme!r}")


def w4a16_batches(n: int, k: int, device: DeviceSpec, group_size: int = 128) -> tuple[int, int]:
    """(b4, b16): from batch b4 the W4A16 layer is compute-bound and its gain starts to fall
    from about 4x; from batch b16 the bfloat16 layer is compute-bound too and W4A16 gains
    nothing. Smallest batches (tokens in the step) where FLOPs / peak >= bytes / bandwidth.

    As m grows, both layers' intensity rises towards n k / (n + k) FLOP/byte (the activations
    dominate the bytes); a layer whose limit is at or below the ridge point is memory-bound
    at every batch, and ValueError says so.
    """
    peak, bw = device.peak_flops("bfloat16"), device.memory_bandwidth_bytes_per_s
    if n * k / (n + k) <= peak / bw:
        raise ValueError(
            f"a {k} -> {n} layer never becomes compute-bound on {device.name}: its intensity "
            f"stays below {n * k / (n + k):.0f} FLOP/byte, the ridge point is {peak / bw:.0f}"
        )

    def first(bytes_of) -> int:
        m = 1
        while 2 * m * n * k / peak < bytes_of(m) / bw:
            m *= 2
        lo, hi = m // 2, m  # the condition is monotone in m: bisect
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if 2 * mid * n * k / peak >= bytes_of(mid) / bw:
                hi = mid
            else:
                lo = mid
        return max(hi, 1)

    b4 = first(lambda m: quant_matmul_bytes(m, n, k, 2, 4, group_size))
    b16 = first(lambda m: gemm_bytes(m, k, n, 2))
    return b4, b16


# -- batch invariance ----------------------------------------------------------------------


def row_in_batch_differs(
    x: torch.Tensor, w: torch.Tensor, batch_sizes: list[int]
) -> dict[int, float]:
    """For each batch size b: max |(x[:1] @ W^T) - (x[:b] @ W^T)[0]|. Zero means row 0's
    result is bitwise the same alone and inside that batch."""
    alone = x[:1] @ w.T
    out = {}
    for b in batch_sizes:
        if not 1 <= b <= x.shape[0]:
            raise ValueError(f"batch size {b} outside 1..{x.shape[0]}")
        out[b] = float((alone - (x[:b] @ w.T)[:1]).abs().max())
    return out
