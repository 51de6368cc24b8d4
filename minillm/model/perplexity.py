"""Perplexity: how surprised a model is by text it has not been trained on.

For token windows t_0 .. t_L, the model predicts each token from the ones before it. The
mean cross-entropy over all N = windows * L predictions, in nats per token, is

    H = -(1 / N) sum log p(t_i | t_<i),

and the perplexity is exp(H): the number of equally likely tokens the model is, on
average, choosing between. A quantized model's perplexity minus the float model's, on the
same windows, is the standard one-number measure of what quantization cost.

The bundled models ship their held-out windows (`heldout_tokens.json`: windows of the token
stream of standard library files the model never trained on), read here directly.
"""

from __future__ import annotations

import json
import math
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

HELDOUT_FILE = "heldout_tokens.json"


def heldout_windows(model_dir: str | pathlib.Path) -> torch.Tensor:
    """The held-out windows beside a model: [num_windows, window_len] int64."""
    path = pathlib.Path(model_dir) / HELDOUT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"expected {HELDOUT_FILE} in {path.parent}")
    windows = json.loads(path.read_text(encoding="utf-8"))["token_ids"]
    return torch.tensor(windows, dtype=torch.int64)


@torch.no_grad()
def mean_cross_entropy(
    model: nn.Module, token_windows: torch.Tensor, batch_size: int = 16
) -> float:
    """Mean next-token cross-entropy in nats over token_windows: [num_windows, window_len]
    (every token but each window's first is predicted), through `model.forward_causal`."""
    if token_windows.dim() != 2 or token_windows.shape[1] < 2:
        raise ValueError(
            f"token_windows must be [num_windows, window_len >= 2], got {list(token_windows.shape)}"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in token_windows.to(device).split(batch_size):
        logits = model.forward_causal(chunk[:, :-1])
        targets = chunk[:, 1:]
        total += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
        count += targets.numel()
    return total / count


@torch.no_grad()
def window_cross_entropy(
    model: nn.Module, token_windows: torch.Tensor, batch_size: int = 16
) -> torch.Tensor:
    """Mean next-token cross-entropy in nats of each window: [num_windows] float64. With
    windows of one length, exp of their mean is `perplexity`; kept apart, they say how much
    a perplexity would move on other windows (`minillm.lab.bootstrap`)."""
    if token_windows.dim() != 2 or token_windows.shape[1] < 2:
        raise ValueError(
            f"token_windows must be [num_windows, window_len >= 2], got {list(token_windows.shape)}"
        )
    device = next(model.parameters()).device
    out = []
    for chunk in token_windows.to(device).split(batch_size):
        logits = model.forward_causal(chunk[:, :-1])
        ce = F.cross_entropy(logits.transpose(1, 2).float(), chunk[:, 1:], reduction="none")
        out.append(ce.double().mean(dim=1).cpu())
    return torch.cat(out)


def perplexity(model: nn.Module, token_windows: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token cross-entropy) over token_windows: [num_windows, window_len]."""
    return math.exp(mean_cross_entropy(model, token_windows, batch_size))
