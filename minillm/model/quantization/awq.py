"""AWQ: scale up the weights of the input channels that carry large activations.

Lin et al., 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration".

A few input channels of a layer carry much larger activations than the rest, so the error
of their weights is multiplied by large x's. For any per-input-channel s > 0,

    y = x W^T = (x / s) (W diag(s))^T,

so quantizing W diag(s) instead of W, and dividing the input by s, computes the same layer
in exact arithmetic. After rounding, the weights of the scaled-up channels have a smaller
relative error (their share of the group's range grows), at the expense of the others. AWQ
chooses

    s = mean_t |x_tk| ^ alpha,   normalized by sqrt(max(s) min(s)),

and grid-searches alpha in [0, 1] (21 points here) for the smallest output error on the
calibration data, ||X W^T - (X / s) Q(W diag(s))^T||^2 = tr(D H D^T) / 2 with
D = W - Q(W diag(s)) diag(s)^-1 and H = 2 X^T X / T. alpha = 0 gives s = 1, plain
round-to-nearest, which is in the grid: the search never ends worse than RTN on its data.

Where the division by s goes: into the operation that produces the input, so that it costs
nothing at run time. The input of q/k/v is an RMSNorm's output, y = g * x / rms(x): divide
the norm's weight g by s. Likewise gate/up after the second norm. The input of down_proj is
silu(gate(x)) * up(x): divide up_proj's output rows by s. The input of o_proj is attention's
output, linear in v: divide v_proj's rows by s — but only when every query head has its own
value head; with grouped-query attention a value channel feeds several heads, and o_proj
keeps s = 1 (as AutoAWQ does). One difference from the paper: the loss is each linear
layer's own output error (summed over the layers sharing an input), not the whole attention
or MLP block's.

The clipping search (`awq_clip_search`, AutoAWQ's `auto_clip`): after scaling, each group of
weights may be better off clipped. A group's grid spans its largest |w|; clipping the
largest few weights to a smaller range spends a little error on them and gives every other
weight a finer grid. For each group of each output channel, the search tries the ranges
max|w| (1 - i/20), i = 0 .. 9 (down to 55%), quantizes the clipped group, and keeps the range
with the smallest output error on the calibration data, d_g^T H_gg d_g with d_g the group's
error against the unclipped weights and H_gg the group's block of the input Hessian (each
group judged alone, as AutoAWQ does). i = 0 is no clipping, so the search never ends worse
on its data. Like AutoAWQ, q_proj and k_proj are not clipped: their errors enter the
attention scores, which the per-layer output error does not see.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.model.quantization.gptq import row_errors
from minillm.model.quantization.rtn import QuantSpec, dequantize, rtn

NUM_GRID_POINTS = 21  # alpha = 0, 0.05, ..., 1
CLIP_GRID = 20  # clipping ranges max|w| (1 - i / CLIP_GRID) ...
CLIP_MAX_SHRINK = 0.5  # ... for i < CLIP_MAX_SHRINK * CLIP_GRID: down to 55%


def scaled_rtn_error(
    weights: list[torch.Tensor], hessian: torch.Tensor, s: torch.Tensor, spec: QuantSpec
) -> float:
    """Output error on the calibration data of round-to-nearest applied to W diag(s), summed
    over layers that share one input: sum tr(D H D^T), D = W - Q(W diag(s)) diag(s)^-1."""
    total = 0.0
    for w in weights:
        w32 = w.detach().float()
        codes, scales, zeros = rtn(w32 * s[None, :], spec)
        w_hat = dequantize(codes, scales, zeros) / s[None, :]
        total += float(row_errors(w32, w_hat, hessian).sum())
    return total


def awq_search(
    weights: list[torch.Tensor],
    hessian: torch.Tensor,
    act_mean: torch.Tensor,
    spec: QuantSpec,
    num_grid_points: int = NUM_GRID_POINTS,
) -> tuple[torch.Tensor, float, list[float]]:
    """The per-input-channel scale s for layers sharing one input.

    weights: [N_i, K] each; hessian: [K, K]; act_mean: mean |x| per input channel, [K].
    Returns (s [K] float32, the alpha chosen, the loss at every alpha); ties keep the
    smaller alpha.
    """
    if num_grid_points < 2:
        raise ValueError(f"num_grid_points must be >= 2, got {num_grid_points}")
    x_mean = act_mean.float().clamp(min=1e-4)
    best_s, best_alpha, best_loss = None, 0.0, float("inf")
    losses = []
    for alpha in torch.linspace(0, 1, num_grid_points).tolist():
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        loss = scaled_rtn_error(weights, hessian, s, spec)
        losses.append(loss)
        if loss < best_loss:
            best_s, best_alpha, best_loss = s, alpha, loss
    return best_s, best_alpha, losses


@torch.no_grad()
def fold_into_norm(norm: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """RMSNorm weight g / s, and the linears' input columns W diag(s): same outputs."""
    norm.weight.copy_((norm.weight.float() / s).to(norm.weight.dtype))
    scale_input_columns(linears, s)


@torch.no_grad()
def fold_into_linear(prev: nn.Linear, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """prev's output rows (and bias) / s, and the linears' input columns W diag(s)."""
    prev.weight.copy_((prev.weight.float() / s[:, None]).to(prev.weight.dtype))
    if prev.bias is not None:
        prev.bias.copy_((prev.bias.float() / s).to(prev.bias.dtype))
    scale_input_columns(linears, s)


def scale_input_columns(linears: list[nn.Linear], s: torch.Tensor) -> None:
    for linear in linears:
        linear.weight.copy_((linear.weight.float() * s[None, :]).to(linear.weight.dtype))


@torch.no_grad()
def awq_clip_search(
    w: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantSpec,
    grid: int = CLIP_GRID,
    max_shrink: float = CLIP_MAX_SHRINK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipping range of each group of w [N, K] with the smallest output error.

    Returns (max_val [N, G]: clip the group to [-max_val, max_val]; error [N, G] at it)."""
    n, k = w.shape
    size = spec.group_size_for(k)
    num_groups = k // size
    w32 = w.detach().float()
    groups = w32.view(n, num_groups, size)
    blocks = torch.stack(
        [hessian[g * size : (g + 1) * size, g * size : (g + 1) * size] for g in range(num_groups)]
    ).float()  # [G, size, size]
    org_max = groups.abs().amax(dim=2)  # [N, G]
    best_max = org_max.clone()
    best_err = torch.full_like(org_max, float("inf"))
    for i in range(max(1, int(max_shrink * grid))):
        max_val = org_max * (1 - i / grid)
        clipped = torch.maximum(torch.minimum(groups, max_val[..., None]), -max_val[..., None])
        codes, scales, zeros = rtn(clipped.reshape(n, k), spec)
        d = (w32 - dequantize(codes, scales, zeros)).view(n, num_groups, size)
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max, best_err


@torch.no_grad()
def clip_weights(linear: nn.Linear, max_val: torch.Tensor) -> None:
    """Clamp each group of linear's weights to [-max_val, max_val] (max_val: [N, G])."""
    k = linear.weight.shape[1]
    size = k // max_val.shape[1]
    limit = max_val.repeat_interleave(size, dim=1).to(linear.weight.dtype)
    linear.weight.copy_(torch.maximum(torch.minimum(linear.weight, limit), -limit))
