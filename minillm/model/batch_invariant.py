"""Batch-invariant execution: one prompt's logits bitwise the same alone or in any batch.

Why they differ otherwise. Floating-point addition is not associative, so a sum's value depends
on the order its terms are added in, and fast kernels choose that order from the shapes they
are given: a matrix multiply over [num_tokens, K] tiles and splits its K-reduction (split-K)
or switches kernels (a matrix-vector product for one row) by num_tokens; batched decode
attention pads every context to the longest one in the batch; a prefill chunk attends with
scores over the chunk's whole context. A token's row then comes out of a differently shaped
computation when the batch around it changes (other requests, or a different chunked-prefill
budget), and its logits change in the last bits, enough to flip a near-tie of greedy decoding.

The fix (what vLLM's `VLLM_BATCH_INVARIANT=1` does with its own kernels on a GPU) is to make
every reduction's order a function of the token alone. Here, on the torch backend:

- every linear layer (the LM head included) multiplies one row at a time, `F.linear` on a
  [1, K] row: the same call with the same shape for a token whatever else is in the batch,
  and no reduction split across rows;
- attention computes each query token alone over exactly the keys it sees
  (`minillm.model.attention.batch_invariant_attention`), with no padding;
- the rest of the model is already per row: embedding lookups, RoPE and the elementwise
  activations touch one token at a time, and RMSNorm reduces over one row's hidden size.

The engine turns it on with `EngineArgs(batch_invariant=True)`. The price is speed: one small
matrix-vector product per token per layer instead of one matrix multiply per layer
(`minillm.lab.batch_invariance.batch_invariant_cost` measures it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.attention import TorchAttentionBackend


def rowwise_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b computed one row of x at a time: x [..., K] -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for i in range(rows.shape[0]):
        out[i : i + 1] = F.linear(rows[i : i + 1], weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _rowwise_forward(linear: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return rowwise_linear(x, linear.weight, linear.bias)

    return forward


def enable_batch_invariant(model: nn.Module) -> None:
    """Switch a Llama-family model (torch attention backend, float weights) to batch-invariant
    execution in place: every `nn.Linear` computes row by row and every attention layer
    attends token by token. Parameters and the state_dict are unchanged."""
    for name, module in model.named_modules():
        if hasattr(module, "backend") and not isinstance(module.backend, TorchAttentionBackend):
            raise ValueError(
                f"batch_invariant needs the torch attention backend; {name} uses "
                f"{type(module.backend).__name__}"
            )
        if type(module).__name__.endswith("Linear") and not isinstance(module, nn.Linear):
            raise ValueError(
                f"batch_invariant needs float weights; {name} is a {type(module).__name__}"
            )
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = _rowwise_forward(module)  # an instance attribute: per module
        backend = getattr(module, "backend", None)
        if isinstance(backend, TorchAttentionBackend):
            backend.batch_invariant = True
