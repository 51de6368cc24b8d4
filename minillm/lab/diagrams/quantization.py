"""Chapter 6's diagrams: number formats, group scales, int4 packing, SmoothQuant, GPTQ and
the FP8 KV cache, each drawn from the engine's own definitions and tensors.

- `draw_bit_layouts`: the sign, exponent and mantissa fields of `FloatFormat`s (and an
  `IntFormat`'s code), from their bit counts;
- `draw_group_scales`: an `Int4Linear`'s weight groups along K and its stored `scales` and
  zero points, [K / group_size, N];
- `draw_int4_packing`: the bytes of an `Int4Linear.packed` tensor and which code sits in which
  nibble;
- `draw_smoothquant`: per-channel ranges of activations and weights before and after
  `numerics.smoothquant_scales`;
- `draw_w8a8`: the data flow of a `W8A8Linear`'s forward, with its tensors' shapes and
  dtypes: per-token quantization, the int8 GEMM into int32, the scales in the epilogue;
- `gptq_snapshots` / `draw_gptq_step`: the weights as `gptq_quantize` sees them when it
  quantizes each column (recorded from a real run);
- `draw_kv_fp8_scales`: each layer's FP8 KV cache and the k_scale / v_scale its attention
  backend holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from unittest import mock

import torch

from minillm.lab import numerics
from minillm.lab.diagrams.canvas import Canvas
from minillm.model.quantization import gptq as gptq_module
from minillm.model.quantization.formats import FloatFormat, IntFormat
from minillm.model.quantization.linear import Int4Linear, W8A8Linear
from minillm.model.quantization.rtn import QuantSpec, find_grid

SMALL = 9  # the smallest font the book uses


def _field_label(name: str, bits: int) -> str:
    if bits == 1:
        return name[0]
    if bits <= 3:
        return f"{name[0]}{bits}"
    return f"{name} {bits}"


def bit_fields(fmt: FloatFormat | IntFormat) -> list[tuple[str, int]]:
    """The fields of a format, most significant first: [(name, bits)]."""
    if isinstance(fmt, FloatFormat):
        return [("sign", 1), ("exponent", fmt.exponent_bits), ("mantissa", fmt.mantissa_bits)]
    return [("code", fmt.bits)]


def draw_bit_layouts(formats: Sequence[FloatFormat | IntFormat]) -> Canvas:
    """One row per format: its bits as sign / exponent / mantissa fields, one cell per bit,
    with the largest value and the unit roundoff computed from the layout."""
    bit_w, row_h, name_w, info_w = 0.5, 0.9, 2.6, 3.6
    max_bits = max(f.bits for f in formats)
    width = name_w + max_bits * bit_w + info_w
    c = Canvas(width, row_h * len(formats) + 0.8)
    kinds = {"sign": "accent", "exponent": "compute", "mantissa": "request", "code": "memory"}
    for row, fmt in enumerate(formats):
        y = c.height - 0.6 - (row + 1) * row_h
        c.text(name_w - 0.2, y + 0.35, fmt.name, ha="right")
        x = name_w
        for name, bits in bit_fields(fmt):
            if bits == 0:
                continue
            c.box(
                x,
                y,
                bits * bit_w,
                0.7,
                _field_label(name, bits),
                kinds[name],
                rounded=False,
                fill=0.6,
                fontsize=SMALL,
            )
            for i in range(1, bits):  # one tick per bit
                c.ax.plot([x + i * bit_w] * 2, [y, y + 0.12], color="#888888", lw=0.6)
            x += bits * bit_w
        if isinstance(fmt, FloatFormat):
            info = f"max {fmt.max:.3g}, u = 2^-{fmt.mantissa_bits + 1}"
        else:
            low, high = fmt.unsigned_range
            info = f"codes {low}..{high}, w = s (q - z)"
        c.text(name_w + max_bits * bit_w + 0.2, y + 0.35, info, ha="left", size=SMALL)
    c.text(
        name_w + max_bits * bit_w / 2,
        c.height - 0.3,
        "bits, most significant first",
        size=SMALL,
        color="#6F6F6F",
    )
    return c


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def scale_exponent(values: torch.Tensor) -> int:
    """The power of ten a diagram divides small scales by so that they read as 1-2 digits."""
    biggest = float(values.abs().max())
    return math.floor(math.log10(biggest)) if 0 < biggest < 0.1 else 0


def draw_group_scales(layer: Int4Linear, rows: int = 4) -> Canvas:
    """A W4A16 layer's weight [N, K] with its groups along K, and the `scales` and zero points
    it stores, [K / group_size, N] (group-major), for the first `rows` output channels. Group 1
    of channel 0 and its scale and zero point are highlighted."""
    n = min(rows, layer.out_features)
    k, g = layer.in_features, layer.group_size
    num_groups = k // g
    cell, sw, zw, sh = 0.55, 1.3, 1.0, 0.7
    w_width = k * cell
    gap = 1.2
    width = 1.3 + w_width + gap + n * sw + 0.4 + n * zw + 0.3
    height = 1.5 + max(n * cell, num_groups * sh) + 0.9
    c = Canvas(width, height)
    top = height - 1.3
    x0 = 1.3
    c.text(x0 + w_width / 2, height - 0.35, f"weight W [N = {layer.out_features}, K = {k}]")
    for gi in range(num_groups):
        kind = "request" if gi % 2 == 0 else "host"
        for row in range(n):
            here = "accent" if (gi, row) == (1, 0) else kind
            c.box(
                x0 + gi * g * cell,
                top - (row + 1) * cell,
                g * cell,
                cell,
                "",
                here,
                rounded=False,
                fill=0.45 if here == "accent" else 0.7,
            )
        c.text(x0 + (gi + 0.5) * g * cell, top + 0.3, f"group {gi}", size=SMALL)
    for row in range(n):
        c.text(x0 - 0.15, top - (row + 0.5) * cell, f"n={row}", ha="right", size=SMALL)
    scales = layer.scales.float()[:, :n]  # [G, N]
    zeros = layer.zeros().T[:, :n]  # [G, N]
    e = scale_exponent(scales)
    sx = x0 + w_width + gap
    zx = sx + n * sw + 0.4
    scale_title = f"scales [G, N] x 1e{e}" if e else "scales [G, N]"
    c.text(sx + n * sw / 2, height - 0.35, scale_title)
    c.text(zx + n * zw / 2, height - 0.35, "zero points")
    for gi in range(num_groups):
        for row in range(n):
            here = "accent" if (gi, row) == (1, 0) else "memory"
            c.box(
                sx + row * sw,
                top - (gi + 1) * sh,
                sw,
                sh,
                f"{float(scales[gi, row]) / 10**e:.3g}",
                here,
                rounded=False,
                fill=0.75,
                fontsize=SMALL,
            )
            c.box(
                zx + row * zw,
                top - (gi + 1) * sh,
                zw,
                sh,
                str(int(zeros[gi, row])),
                here,
                rounded=False,
                fill=0.75,
                fontsize=SMALL,
            )
    c.text(
        x0 + w_width / 2,
        top - n * cell - 0.45,
        "w = s (q - z): one scale and zero point per group",
        size=SMALL,
        color="#C44E52",
    )
    c.text(
        sx + (n * sw + 0.4 + n * zw) / 2,
        top - num_groups * sh - 0.4,
        "row g, column n: group g of channel n",
        size=SMALL,
        color="#6F6F6F",
    )
    return c


def draw_int4_packing(layer: Int4Linear, row: int = 0, num_bytes: int = 4) -> Canvas:
    """The first `num_bytes` bytes of one row of `layer.packed` and the codes in their
    nibbles: byte i holds code 2i in its low nibble and code 2i + 1 in its high nibble."""
    packed = layer.packed[row, :num_bytes].to(torch.int32)
    codes = layer.codes()[row, : 2 * num_bytes]
    cw = 1.1
    width = 2 * num_bytes * cw + 2.6
    c = Canvas(width, 5.0)
    x0 = 2.4
    c.text(x0 - 0.2, 4.05, "codes q (K order)", ha="right", size=SMALL)
    code_boxes = []
    for j, q in enumerate(codes.tolist()):
        code_boxes.append(
            c.box(x0 + j * cw + 0.05, 3.7, cw - 0.1, 0.7, f"k{j}: {q}", "request", fontsize=SMALL)
        )
    c.text(x0 - 0.2, 1.65, "packed bytes", ha="right", size=SMALL)
    for i, byte in enumerate(packed.tolist()):
        x = x0 + 2 * i * cw
        high, low = byte >> 4, byte & 0xF
        lo_box = c.box(
            x + 0.05, 1.3, cw - 0.05, 0.7, f"lo {low:X}", "memory", rounded=False, fontsize=SMALL
        )
        hi_box = c.box(
            x + cw,
            1.3,
            cw - 0.05,
            0.7,
            f"hi {high:X}",
            "memory",
            rounded=False,
            fontsize=SMALL,
            fill=0.7,
        )
        c.text(x + cw, 0.85, f"byte {i} = 0x{byte:02X}", size=SMALL)
        c.arrow(code_boxes[2 * i], lo_box, sides=("bottom", "top"))
        c.arrow(code_boxes[2 * i + 1], hi_box, sides=("bottom", "top"))
    c.text(
        width / 2,
        0.3,
        "uint8: bits 0-3 (lo) = even k, bits 4-7 (hi) = odd k",
        size=SMALL,
        color="#6F6F6F",
    )
    return c


def draw_smoothquant(
    x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float, channels: Sequence[int]
) -> Canvas:
    """Per input channel j: max|X_j| and max|W_j| before, the scale s_j, and both after
    SmoothQuant divides X_j by s_j and multiplies W_j by it."""
    s = numerics.smoothquant_scales(x_amax, w_amax, alpha)
    rows = [
        ("max |X_j|", x_amax, "compute"),
        ("max |W_j|", w_amax, "memory"),
        (f"s_j (alpha {alpha:g})", s, "accent"),
        ("max |X_j| / s_j", x_amax / s, "compute"),
        ("max |W_j| * s_j", w_amax * s, "memory"),
    ]
    cw, rh, name_w = 1.05, 0.62, 3.2
    width = name_w + cw * len(channels) + 0.3
    c = Canvas(width, rh * len(rows) + 2.0)
    top = c.height - 0.9
    for j, ch in enumerate(channels):
        c.text(name_w + (j + 0.5) * cw, top + 0.3, f"j={ch}", size=SMALL)
    for r, (name, values, kind) in enumerate(rows):
        y = top - (r + 1) * rh - (0.35 if r >= 3 else 0) - (0.1 if r >= 2 else 0)
        c.text(name_w - 0.15, y + rh / 2, name, ha="right", size=SMALL)
        biggest = float(values[list(channels)].abs().max())
        for j, ch in enumerate(channels):
            v = float(values[ch])
            c.box(
                name_w + j * cw,
                y,
                cw,
                rh,
                _fmt(v),
                kind,
                rounded=False,
                fill=0.9 - 0.6 * (v / biggest),
                fontsize=SMALL,
            )
    c.text(
        width / 2,
        0.2,
        "the product X W^T is unchanged: (X / s)(W s)^T",
        size=SMALL,
        color="#6F6F6F",
    )
    return c


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def draw_w8a8(layer: W8A8Linear, tokens: int, act_dtype: torch.dtype = torch.bfloat16) -> Canvas:
    """One forward of `layer` on [tokens, K] activations: x is (divided by the layer's
    SmoothQuant factors where it keeps them and) quantized per token; the int8 codes of x
    and W meet in an int8 GEMM that sums in int32; the per-token and per-channel scales
    multiply each int32 sum once, in the epilogue."""
    n, k = layer.out_features, layer.in_features
    m = tokens
    c = Canvas(16.0, 8.0)
    h, f = 0.9, SMALL
    act = _dtype_name(act_dtype)
    x = c.box(0.3, 6.8, 3.2, h, f"x [{m}, {k}] {act}", "request", fontsize=f)
    if layer.input_smooth is not None:
        step = c.box(4.1, 6.8, 2.6, h, "x / s (SmoothQuant)", "accent", fontsize=f)
    else:
        step = c.box(4.1, 6.8, 2.6, h, "s folded before", "accent", fontsize=f, dashed=True)
    quant = c.box(7.3, 6.8, 4.3, h, "per token: sx = max|x_m| / 127", "compute", fontsize=f)
    sx = c.box(0.3, 5.0, 3.2, h, f"sx [{m}] float32", "memory", fontsize=f)
    qx = c.box(8.0, 5.0, 3.0, h, f"qx [{m}, {k}] int8", "memory", fontsize=f)
    acc = c.box(4.1, 3.2, 2.9, h, f"acc [{m}, {n}] int32", "memory", fontsize=f)
    gemm = c.box(8.0, 3.2, 3.0, h, "int8 x int8 GEMM", "compute", fontsize=f, bold=True)
    qw_label = f"qw [{n}, {k}] {_dtype_name(layer.qweight.dtype)}"
    qw = c.box(12.0, 3.2, 3.6, h, qw_label, "memory", fontsize=f)
    epi = c.box(4.1, 1.4, 4.5, h, "epilogue: acc sx_m sw_n", "compute", fontsize=f)
    sw_label = f"sw [{n}] {_dtype_name(layer.scales.dtype)}"
    sw = c.box(12.0, 1.4, 3.6, h, sw_label, "memory", fontsize=f)
    y = c.box(4.85, 0.1, 3.0, h * 0.9, f"y [{m}, {n}] {act}", "request", fontsize=f)
    c.arrow(x, step)
    c.arrow(step, quant)
    c.arrow(quant, qx, sides=("bottom", "top"))
    c.arrow(quant, sx, sides=("bottom", "right"))
    c.arrow(qx, gemm, sides=("bottom", "top"))
    c.arrow(qw, gemm, sides=("left", "right"))
    c.arrow(gemm, acc, sides=("left", "right"))
    c.arrow(acc, epi, sides=("bottom", "top"))
    c.arrow(sx, epi, sides=("bottom", "left"), dashed=True)
    c.arrow(sw, epi, sides=("left", "right"), dashed=True)
    c.arrow(epi, y, sides=("bottom", "top"))
    c.text(13.8, 4.5, "stored, quantized once", size=f, color="#6F6F6F")
    c.text(1.9, 6.2, "computed on each call", size=f, color="#6F6F6F")
    return c


@dataclass(slots=True)
class GptqSnapshot:
    """The weights of the block when `gptq_quantize` quantized `column` (in its order)."""

    column: int  # position in the quantization order
    weights: torch.Tensor  # [N, block] as the column saw them, earlier columns' errors absorbed
    codes: torch.Tensor  # [N] the codes chosen for this column


def gptq_snapshots(
    w: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec
) -> tuple[list[GptqSnapshot], torch.Tensor]:
    """Run minillm's `gptq_quantize` on w [N, K] (one block, natural column order) and record
    the block's weights each time a column is rounded. Returns the snapshots and the codes."""
    scales, zeros = find_grid(w, spec)
    real_round = gptq_module.round_to_grid
    snapshots: list[GptqSnapshot] = []

    def recording(column_values, s, z, spec_):
        block = column_values._base  # the block W1 the column is a view of
        if block is None:
            raise RuntimeError("gptq_quantize no longer passes a view of its block")
        q = real_round(column_values, s, z, spec_)
        snapshots.append(GptqSnapshot(len(snapshots), block.clone(), q.clone()))
        return q

    with mock.patch.object(gptq_module, "round_to_grid", recording):
        codes = gptq_module.gptq_quantize(w, hessian, scales, zeros, spec, block_size=w.shape[1])
    return snapshots, codes


def draw_gptq_step(original: torch.Tensor, snapshots: Sequence[GptqSnapshot], step: int) -> Canvas:
    """Left: W as it came; right: the moment GPTQ rounds column `step`: earlier columns are
    codes, this column is rounded, later columns hold values updated by the error feedback."""
    n, k = original.shape
    snap = snapshots[step]
    cw, rh = 0.95, 0.6
    gap = 1.4
    width = 2 * k * cw + gap + 0.6
    c = Canvas(width, n * rh + 1.6)
    top = c.height - 0.9
    e = scale_exponent(original)
    unit = f" (x 1e{e})" if e else ""
    c.text(0.3 + k * cw / 2, c.height - 0.35, f"W before{unit}")
    c.text(0.3 + k * cw + gap + k * cw / 2, c.height - 0.35, f"quantizing column {step}")
    for col in range(k):
        for row in range(n):
            y = top - (row + 1) * rh
            c.box(
                0.3 + col * cw,
                y,
                cw,
                rh,
                _fmt(float(original[row, col]) / 10**e),
                "free",
                rounded=False,
                fill=0.4,
                fontsize=SMALL,
            )
            x = 0.3 + k * cw + gap + col * cw
            if col < step:
                code = int(snapshots[col].codes[row])
                c.box(x, y, cw, rh, f"q={code}", "memory", rounded=False, fill=0.55, fontsize=SMALL)
            elif col == step:
                c.box(
                    x,
                    y,
                    cw,
                    rh,
                    f"q={int(snap.codes[row])}",
                    "accent",
                    rounded=False,
                    fill=0.5,
                    fontsize=SMALL,
                    bold=True,
                )
            else:
                c.box(
                    x,
                    y,
                    cw,
                    rh,
                    _fmt(float(snap.weights[row, col]) / 10**e),
                    "compute",
                    rounded=False,
                    fill=0.7,
                    fontsize=SMALL,
                )
    xs = 0.3 + k * cw + gap + (step + 0.5) * cw
    if step + 1 < k:
        c.arrow(
            (xs, top - n * rh - 0.1),
            (xs + 1.4 * cw, top - n * rh - 0.1),
            "error feedback",
            kind="accent",
            curve=0.4,
            label_offset=(0.6, -0.5),
        )
    c.arrow((0.3 + k * cw + 0.1, top - n * rh / 2), (0.3 + k * cw + gap - 0.1, top - n * rh / 2))
    return c


def kv_fp8_layer_scales(model) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of every decoder layer's attention backend, in layer order."""
    return [
        (float(layer.self_attn.backend.k_scale), float(layer.self_attn.backend.v_scale))
        for layer in model.model.layers
    ]


def draw_kv_fp8_scales(model, kv_caches: Sequence[torch.Tensor]) -> Canvas:
    """Each layer's KV cache as the engine holds it (dtype, bytes per element) and the
    per-layer k_scale and v_scale its attention multiplies the FP8 codes by on read."""
    scales = kv_fp8_layer_scales(model)
    rh = 0.8
    width = 12.0
    c = Canvas(width, rh * len(scales) + 1.5)
    top = c.height - 0.8
    c.text(1.0, top + 0.35, "layer", size=SMALL)
    c.text(4.3, top + 0.35, "K cache", size=SMALL)
    c.text(9.2, top + 0.35, "V cache", size=SMALL)
    for i, ((k_scale, v_scale), cache) in enumerate(zip(scales, kv_caches, strict=True)):
        y = top - (i + 1) * rh
        dtype = str(cache.dtype).replace("torch.", "")
        c.text(1.0, y + rh / 2 - 0.05, str(i), size=SMALL)
        c.box(
            2.0,
            y + 0.05,
            4.6,
            rh - 0.12,
            f"{dtype} · k_scale {k_scale:.3g}",
            "memory",
            rounded=False,
            fontsize=SMALL,
        )
        c.box(
            6.9,
            y + 0.05,
            4.6,
            rh - 0.12,
            f"{dtype} · v_scale {v_scale:.3g}",
            "memory",
            rounded=False,
            fill=0.7,
            fontsize=SMALL,
        )
    c.text(
        width / 2,
        0.35,
        "write: q = fp8(clamp(k / k_scale, ±448));  read: k ≈ q · k_scale",
        size=SMALL,
        color="#6F6F6F",
    )
    return c


__all__ = [
    "GptqSnapshot",
    "bit_fields",
    "draw_bit_layouts",
    "draw_gptq_step",
    "draw_group_scales",
    "draw_int4_packing",
    "draw_kv_fp8_scales",
    "draw_smoothquant",
    "draw_w8a8",
    "gptq_snapshots",
    "kv_fp8_layer_scales",
    "scale_exponent",
]
