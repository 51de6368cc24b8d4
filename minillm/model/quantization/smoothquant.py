"""SmoothQuant: move the activations' outlier range into the weights before W8A8.

Xiao et al., 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models".

Per-token int8 activations give each token one scale, set by its largest |x|. A few input
channels carry activations tens of times larger than the rest, in every token, so the scale
they set leaves the other channels a handful of codes. Weights have no such outliers. For
any per-input-channel s > 0,

    y = x W^T = (x / s) (W diag(s))^T,

and SmoothQuant chooses, from calibration activations,

    s_j = max_t |x_tj|^alpha / max_n |W_nj|^(1 - alpha),

with alpha = 0.5 by default: channel j then has the same range sqrt(max|X_j| max|W_j|) in
both operands. alpha = 0 leaves all the range in the activations, alpha = 1 moves it all
into the weights. Layers that share one input (q, k, v; gate, up) share one s; max|W_j| is
then taken over all of them.

Where the division goes (`apply_smoothquant`): into the operation that produces the input,
so that it costs nothing at run time. After an RMSNorm (q/k/v, gate/up) the norm's weight
is divided by s, which is where the paper smooths; down_proj's input, silu(gate) * up, is
divided through up_proj's output rows; o_proj's input, attention's output, through v_proj's
rows when every query head has its own value head. Where no such fold exists (o_proj with
grouped-query attention) the layer keeps s and divides its input by it before quantizing
(`W8A8Linear.input_smooth`): one elementwise op more, the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_ALPHA = 0.5
MIN_RANGE = 1e-5  # a channel that never fires (or a zero weight column) counts as this


def smoothquant_factors(
    act_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float = DEFAULT_ALPHA
) -> torch.Tensor:
    """s [K] float32 for layers sharing one input: act_amax [K] is max_t |x_tj| over the
    calibration tokens, weights [N_i, K] each."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"SmoothQuant's alpha must be in [0, 1], got {alpha}")
    k = act_amax.shape[0]
    if not weights or any(w.dim() != 2 or w.shape[1] != k for w in weights):
        raise ValueError(f"weights must be [N, {k}] matrices sharing the input")
    w_amax = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    x_range = act_amax.float().clamp(min=MIN_RANGE)
    w_range = w_amax.clamp(min=MIN_RANGE)
    return x_range.pow(alpha) / w_range.pow(1 - alpha)


@torch.no_grad()
def apply_smoothquant(layer: nn.Module, act_amax: dict[str, torch.Tensor], alpha: float) -> dict:
    """Smooth one Llama decoder layer in place, from the calibration max |x| per input
    channel of its linears (keyed by "self_attn.q_proj", ...). Returns the factors that could
    not be folded, by linear name (o_proj under GQA): its input must be divided by them."""
    from minillm.model.quantization.awq import fold_into_linear, fold_into_norm

    attn, mlp = layer.self_attn, layer.mlp
    groups = [
        (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj"),
        (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj"),
        (mlp.up_proj, [mlp.down_proj], "mlp.down_proj"),
    ]
    unfolded = {}
    if attn.v_proj.out_features == attn.o_proj.in_features:  # no GQA: v's rows feed o alone
        groups.append((attn.v_proj, [attn.o_proj], "self_attn.o_proj"))
    else:
        s = smoothquant_factors(act_amax["self_attn.o_proj"], [attn.o_proj.weight], alpha)
        attn.o_proj.weight.copy_((attn.o_proj.weight.float() * s).to(attn.o_proj.weight.dtype))
        unfolded["self_attn.o_proj"] = s
    for prev, linears, input_of in groups:
        s = smoothquant_factors(act_amax[input_of], [lin.weight for lin in linears], alpha)
        if isinstance(prev, nn.Linear):
            fold_into_linear(prev, linears, s)
        else:
            fold_into_norm(prev, linears, s)
    return unfolded
