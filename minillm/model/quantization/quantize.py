"""`quantize_model`: replace a Llama-family model's linear layers by quantized ones, in place.

What is quantized: the seven linear layers of every decoder layer (q, k, v, o; gate, up,
down), which hold nearly all of a large model's weights and are read in full by every decode
step. What stays float: the embedding, a table lookup that reads one row per token, so its
size is memory but not traffic; and the LM head, whose output is the logits themselves —
its errors shift every token's score, so GPTQ's and AWQ's tools and vLLM keep it in 16 bits
by default (in the bundled models it is also the embedding, tied). Norms stay float too.

W8A8 quantizes the activations too, per token at run time (`W8A8Linear`); its weights are
int8 per output channel. With method "smoothquant" each decoder layer is first smoothed
(`minillm.model.quantization.smoothquant`) from its calibration activations' max |x|.

RTN and FP8 need only the weights. GPTQ, AWQ and SmoothQuant need calibration windows: the
decoder layers are processed in order, each one fed the calibration hidden states produced by
the layers before it, already quantized — so a layer's codes compensate for the errors
upstream. In one
pass through a layer, hooks record the inputs' statistics of its seven linears (float32
[K, K] Hessians, never the activations); then its linears are quantized and the pass is run
again to produce the next layer's inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.model.quantization.awq import (
    awq_clip_search,
    awq_search,
    clip_weights,
    fold_into_linear,
    fold_into_norm,
)
from minillm.model.quantization.calibration import LinearInputStats
from minillm.model.quantization.gptq import gptq
from minillm.model.quantization.linear import (
    KERNEL_GROUP_SIZES,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    W8A8Linear,
    linear_layers,
)
from minillm.model.quantization.rtn import INT8_PER_CHANNEL, QuantSpec, int4_spec, rtn
from minillm.model.quantization.smoothquant import DEFAULT_ALPHA, apply_smoothquant

# "int8": W8A16; "int4": W4A16; "fp8": FP8 weight-only (emulated); "w8a8": int8 weights and
# per-token int8 activations
QUANTIZATIONS = ("int8", "int4", "fp8", "w8a8")
METHODS = ("rtn", "gptq", "awq", "smoothquant")
# the methods each format can use: SmoothQuant prepares activations, so it is W8A8's only
METHODS_FOR = {
    "int8": ("rtn", "gptq", "awq"),
    "int4": ("rtn", "gptq", "awq"),
    "fp8": ("rtn",),
    "w8a8": ("rtn", "smoothquant"),
}
LINEAR_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
CALIBRATION_BATCH = 8  # windows per forward pass while calibrating


def check_quantization_args(quantization: str, group_size: int, method: str) -> None:
    """Raise ValueError unless the three options name something `quantize_model` does."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if method not in METHODS:
        raise ValueError(f"quantization method must be one of {METHODS}, got {method!r}")
    if method not in METHODS_FOR[quantization]:
        raise ValueError(
            f"quantization {quantization!r} takes method {' or '.join(METHODS_FOR[quantization])}"
            f", got {method!r}"
        )
    if isinstance(group_size, bool) or group_size not in KERNEL_GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {KERNEL_GROUP_SIZES} (the W4A16 kernel's), "
            f"got {group_size!r}"
        )


def quantization_spec(quantization: str, group_size: int) -> QuantSpec | None:
    """int8 and w8a8: symmetric per output channel; int4: zero points per group; fp8: None."""
    if quantization in ("int8", "w8a8"):
        return INT8_PER_CHANNEL
    if quantization == "int4":
        return int4_spec(group_size)
    return None


def set_submodule(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(layer.get_submodule(parent), child, module)


def make_quantized(
    linear: nn.Linear,
    quantization: str,
    codes_scales_zeros: tuple | None,
    group_size: int,
    input_smooth: torch.Tensor | None = None,
) -> QuantizedLinear:
    """The quantized layer for `linear` from its codes, scales and zeros (fp8: none)."""
    bias, dtype = linear.bias, linear.weight.dtype
    if quantization == "fp8":
        return Fp8Linear(linear.weight, bias)
    codes, scales, zeros = codes_scales_zeros
    if quantization == "int8":
        return Int8Linear(codes, scales, bias, dtype)
    if quantization == "w8a8":
        return W8A8Linear(codes, scales, bias, dtype, input_smooth)
    return Int4Linear(codes, scales, zeros, group_size, bias, dtype)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    quantization: str,
    group_size: int = 128,
    method: str = "rtn",
    calibration: torch.Tensor | None = None,
    act_order: bool = True,
    smoothquant_alpha: float = DEFAULT_ALPHA,
) -> nn.Module:
    """Quantize a `LlamaForCausalLM`'s decoder linears in place; returns the model.

    quantization: "int8" (W8A16, per channel), "int4" (W4A16, group-wise with zero points)
    "fp8" (E4M3 weights, per channel, weight-only) or "w8a8" (int8 weights per channel,
    int8 activations per token); group_size: input channels per int4 scale; method: how the
    integer codes are chosen, "rtn", "gptq" or "awq", or for w8a8 "rtn" or "smoothquant"
    (smooth, then round to nearest; `smoothquant_alpha` its migration strength); calibration:
    token ids
    [num_windows, seq_len] (GPTQ, AWQ, SmoothQuant; see `default_calibration`); act_order: GPTQ's
    columns in order of decreasing activation energy (free at inference here, see
    `minillm.model.quantization.gptq`; on the bundled model GPTQ loses less perplexity with
    it, see benchmarks/results/quantization_cpu.json).
    """
    check_quantization_args(quantization, group_size, method)
    if linear_layers(model):
        raise ValueError(
            "the model is already quantized (a GPTQ or AWQ checkpoint, or quantized before)"
        )
    if method != "rtn" and (calibration is None or calibration.dim() != 2):
        raise ValueError(
            f"method {method!r} needs calibration token ids [num_windows, seq_len]; "
            "minillm.model.quantization.default_calibration(model_dir) makes some"
        )
    spec = quantization_spec(quantization, group_size)
    layers = model.model.layers
    if method == "rtn":
        for layer in layers:
            for name in LINEAR_NAMES:
                linear = layer.get_submodule(name)
                dtype = linear.weight.dtype
                result = None if spec is None else rtn(linear.weight, spec, dtype)
                set_submodule(layer, name, make_quantized(linear, quantization, result, group_size))
        return model

    device = next(model.parameters()).device
    ids = calibration.to(device)
    positions = torch.arange(ids.shape[1], device=device)
    hidden = [model.model.embed_tokens(chunk) for chunk in ids.split(CALIBRATION_BATCH)]
    rope = model.model.make_rope(positions, hidden[0].dtype)
    for layer in layers:
        linears = {name: layer.get_submodule(name) for name in LINEAR_NAMES}
        stats = LinearInputStats(linears)
        for h in hidden:
            layer(h, rope, None, None)
        stats.remove()
        unfolded = {}
        if method == "awq":
            scaled = apply_awq_scales(layer, stats, spec)
            apply_awq_clipping(linears, stats, scaled, spec)
        elif method == "smoothquant":
            amax = {name: stats.amax(name) for name in LINEAR_NAMES}
            unfolded = apply_smoothquant(layer, amax, smoothquant_alpha)
        for name, linear in linears.items():
            hessian, _ = stats.result(name)
            dtype = linear.weight.dtype
            if method == "gptq":
                result = gptq(linear.weight, hessian, spec, act_order=act_order, dtype=dtype)
            else:
                result = rtn(linear.weight, spec, dtype)
            quantized = make_quantized(linear, quantization, result, group_size, unfolded.get(name))
            set_submodule(layer, name, quantized)
        hidden = [layer(h, rope, None, None) for h in hidden]
    return model


def apply_awq_scales(
    layer: nn.Module, stats: LinearInputStats, spec: QuantSpec
) -> dict[str, torch.Tensor]:
    """Search AWQ's scales for each group of linears sharing an input and fold them into the
    operation before (see `minillm.model.quantization.awq`). Returns each scaled linear's
    s by name: its input is now x / s."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [
        (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj"),
        (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj"),
        (mlp.up_proj, [mlp.down_proj], "mlp.down_proj"),
    ]
    if attn.v_proj.out_features == attn.o_proj.in_features:  # no GQA: v's rows feed o alone
        groups.append((attn.v_proj, [attn.o_proj], "self_attn.o_proj"))
    names = {id(module): name for name, module in layer.named_modules()}
    scaled = {}
    for prev, linears, input_of in groups:
        hessian, act_mean = stats.result(input_of)
        s, _, _ = awq_search([lin.weight for lin in linears], hessian, act_mean, spec)
        if isinstance(prev, nn.Linear):
            fold_into_linear(prev, linears, s)
        else:
            fold_into_norm(prev, linears, s)
        scaled.update({names[id(lin)]: s for lin in linears})
    return scaled


def apply_awq_clipping(
    linears: dict[str, nn.Linear],
    stats: LinearInputStats,
    scaled: dict[str, torch.Tensor],
    spec: QuantSpec,
) -> None:
    """AWQ's clipping search on every linear but q_proj and k_proj, after scaling: the
    Hessian of a scaled input x / s is diag(1/s) H diag(1/s)."""
    for name, linear in linears.items():
        if name in ("self_attn.q_proj", "self_attn.k_proj"):
            continue
        hessian, _ = stats.result(name)
        s = scaled.get(name)
        if s is not None:
            hessian = hessian / (s[:, None] * s[None, :])
        max_val, _ = awq_clip_search(linear.weight, hessian, spec)
        clip_weights(linear, max_val)
