"""What the quantization tests share: a tiny random Llama built in memory (dims that the int4
group sizes 32 and 64 divide), and the plain float reference every quantized layer is
checked against."""

from __future__ import annotations

import torch

from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="LlamaForCausalLM",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Random weights (std 0.1, norms around 1), float32, eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The oracle: x @ w.T (+ b) in float64, for a float weight the test built itself."""
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||X W^T - X W^^T||^2 over calibration inputs X, in float64."""
    return float(((x.double() @ (w.double() - w_hat.double()).T) ** 2).sum())
