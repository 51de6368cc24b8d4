"""The residual add fused into the RMSNorm that follows it, against plain PyTorch written here.

`RMSNorm(x, residual=r)` must return (norm(x + r), x + r); a model whose layers pass the
residual stream and their MLP output unadded (`forward_fused`) must compute, in float32, the
same bits as the textbook block x = x + attn(norm(x)); x = x + mlp(norm(x)).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM, RMSNorm
from tests.engine.test_model import ARCHS, load_minillm


def oracle_add_norm(x, residual, weight, eps):
    """Plain arithmetic, one step per line: h = x + r; y = w * h / sqrt(mean(h^2) + eps)."""
    h = x + residual
    h64 = h.double()
    y = h64 / torch.sqrt((h64 * h64).sum(dim=-1, keepdim=True) / h.shape[-1] + eps)
    return (weight.double() * y).to(x.dtype), h


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    hidden=st.sampled_from([1, 8, 64, 96]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_fused_add_norm_matches_the_oracle(rows, hidden, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen) * scale
    residual = torch.randn(rows, hidden, generator=gen) * scale
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    out, new_residual = norm(x, residual=residual)
    expected, expected_residual = oracle_add_norm(x, residual, norm.weight.detach(), 1e-6)
    assert torch.equal(new_residual, expected_residual)  # the add itself is exact
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * scale)
    # and bit for bit what the unfused path gives: add, then norm
    assert torch.equal(out, norm(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_norm_leaves_its_inputs_alone(dtype):
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(4, 32, generator=gen, dtype=dtype), torch.randn(4, 32, dtype=dtype)
    x0, r0 = x.clone(), residual.clone()
    out, h = RMSNorm(32, eps=1e-5).to(dtype)(x, residual=residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    assert out.dtype == h.dtype == dtype
    assert torch.equal(h, x0 + r0)


def unfused_forward_causal(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The textbook pre-norm decoder, one residual add after each sublayer."""
    inner = model.model
    x = inner.embed_tokens(input_ids)
    rope = inner.make_rope(torch.arange(input_ids.shape[1]), x.dtype)
    for layer in inner.layers:
        x = x + layer.self_attn(layer.input_layernorm(x), rope, None, None)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(inner.norm(x)).float()


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_residual_model_equals_the_unfused_block_bit_for_bit(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    model = load_minillm(path)
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 17), generator=torch.Generator())
    with torch.no_grad():
        fused = model.forward_causal(input_ids)
        unfused = unfused_forward_causal(model, input_ids)
        # a decoder layer called alone (as a pipeline stage calls it) is the same block too
        layer = model.model.layers[0]
        x = torch.randn(2, 17, hf.config.hidden_size)
        rope = model.model.make_rope(torch.arange(17), x.dtype)
        h = x + layer.self_attn(layer.input_layernorm(x), rope, None, None)
        alone = h + layer.mlp(layer.post_attention_layernorm(h))
        assert torch.equal(layer(x, rope, None, None), alone)
    assert torch.equal(fused, unfused)
    # a wrong fusion (the final add forgotten, or normalizing before the add) is caught
    with torch.no_grad():
        inner = model.model
        x = inner.embed_tokens(input_ids)
        rope = inner.make_rope(torch.arange(17), x.dtype)
        residual = None
        for layer in inner.layers:
            x, residual = layer.forward_fused(x, residual, rope, None, None)
        forgot_add = model.lm_head(inner.norm(residual)).float()
        norm_first = model.lm_head(inner.norm(x) + residual).float()
    assert not torch.allclose(forgot_add, unfused, atol=1e-3)
    assert not torch.allclose(norm_first, unfused, atol=1e-3)


def test_a_model_without_layers_still_normalizes():
    config = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "num_hidden_layers": 1,
            "vocab_size": 11,
            "max_position_embeddings": 32,
            "rms_norm_eps": 1e-6,
        }
    )
    model = LlamaForCausalLM(config).eval()
    model.model.layers = torch.nn.ModuleList()  # as a trimmed model can be
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3]])
        x = model.model.embed_tokens(ids)
        assert torch.equal(model.model(ids, torch.arange(3), None, None), model.model.norm(x))


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_qkv_split_by_heads_is_the_projections(hf_checkpoint, arch):
    path, _ = hf_checkpoint(arch)
    model = load_minillm(path, fused=True)
    attn = model.model.layers[0].self_attn
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        q, k, v = attn.fused_qkv(x, attn.head_dim)
        assert q.shape == (5, attn.num_heads, attn.head_dim)
        assert k.shape == v.shape == (5, attn.num_kv_heads, attn.head_dim)
        flat = attn.fused_qkv(x)
        for got, want in zip((q, k, v), flat, strict=True):
            assert torch.equal(got.flatten(-2), want)
