"""AWQ's scale search and the folds that hide its scales, checked on the calibration data."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from quant_testing import tiny_model

from minillm.model.quantization.awq import (
    awq_clip_search,
    awq_search,
    clip_weights,
    fold_into_linear,
    fold_into_norm,
)
from minillm.model.quantization.rtn import INT8_PER_CHANNEL, dequantize, int4_spec, rtn


def scaled_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, spec) -> float:
    """sum ||X W^T - (X / s) Q(W diag(s))^T||^2 in float64, written from the definition."""
    total = 0.0
    for w in weights:
        w_hat = dequantize(*rtn(w * s[None, :], spec))
        y_hat = (x.double() / s.double()) @ w_hat.double().T
        total += float(((x.double() @ w.double().T - y_hat) ** 2).sum())
    return total


def activations(t: int, k: int, outliers: int, gen: torch.Generator) -> torch.Tensor:
    """Inputs with a few channels 20x larger than the rest, as LLM activations have."""
    x = torch.randn(t, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:outliers]] *= 20
    return x


@given(
    num_layers=st.integers(1, 3),
    n=st.integers(1, 16),
    k=st.sampled_from([32, 64]),
    t=st.integers(4, 64),
    outliers=st.integers(0, 4),
    int8=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_search_never_ends_worse_than_scale_one(num_layers, n, k, t, outliers, int8, seed):
    gen = torch.Generator().manual_seed(seed)
    x = activations(t, k, outliers, gen)
    weights = [torch.randn(n, k, generator=gen) * 0.1 for _ in range(num_layers)]
    spec = INT8_PER_CHANNEL if int8 else int4_spec(32)
    hessian = 2 * x.T @ x / t
    s, alpha, losses = awq_search(weights, hessian, x.abs().mean(dim=0), spec)
    rtn_error = scaled_error(x, weights, torch.ones(k), spec)
    assert scaled_error(x, weights, s, spec) <= rtn_error * (1 + 1e-4) + 1e-9
    # the search's loss is the same quantity, through H (T = t rows, H = 2 X^T X / t)
    assert losses[0] * t / 2 == pytest.approx(rtn_error, rel=1e-4, abs=1e-7)
    assert len(losses) == 21 and min(losses) == losses[round(alpha * 20)]
    assert (s > 0).all()


def test_outlier_channels_get_scaled_up_and_the_error_drops():
    gen = torch.Generator().manual_seed(0)
    x = activations(256, 128, 3, gen)
    w = torch.randn(64, 128, generator=gen) * 0.05
    spec = int4_spec(128)
    s, alpha, _ = awq_search([w], 2 * x.T @ x / 256, x.abs().mean(dim=0), spec)
    assert alpha > 0
    big = x.abs().mean(dim=0) > 5
    assert s[big].min() > s[~big].max()  # the outlier channels' weights are scaled up
    assert scaled_error(x, [w], s, spec) < 0.8 * scaled_error(x, [w], torch.ones(128), spec)


def test_folding_the_scales_leaves_the_float_model_unchanged():
    model = tiny_model()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    before = model.forward_causal(ids)
    gen = torch.Generator().manual_seed(1)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    fold_into_norm(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj],
                   torch.rand(64, generator=gen) + 0.5)  # fmt: skip
    fold_into_norm(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj],
                   torch.rand(64, generator=gen) + 0.5)  # fmt: skip
    fold_into_linear(mlp.up_proj, [mlp.down_proj], torch.rand(128, generator=gen) + 0.5)
    after = model.forward_causal(ids)
    assert not torch.equal(before, after)  # the weights did change ...
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)  # ... the outputs did not


def test_folding_into_v_proj_without_gqa_leaves_the_model_unchanged():
    model = tiny_model(num_key_value_heads=4, attention_bias=True)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    before = model.forward_causal(ids)
    attn = model.model.layers[1].self_attn
    s = torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5
    fold_into_linear(attn.v_proj, [attn.o_proj], s)
    torch.testing.assert_close(model.forward_causal(ids), before, atol=1e-5, rtol=1e-5)


def test_a_single_grid_point_is_refused():
    with pytest.raises(ValueError, match="num_grid_points"):
        awq_search([torch.zeros(2, 32)], torch.eye(32), torch.ones(32), int4_spec(32), 1)


def clip_oracle(x: torch.Tensor, w: torch.Tensor, group_size: int, ratios) -> torch.Tensor:
    """The clipping search written from its definition, one group at a time: clip the group,
    round it to nearest (int4 with a zero point), and measure the group's share of the
    output error on the calibration inputs, sum_t (x_tg . (w_g - w^_g))^2, in float64."""
    n, k = w.shape
    best = torch.zeros(n, k // group_size, dtype=torch.float64)
    for row in range(n):
        for g in range(k // group_size):
            cols = slice(g * group_size, (g + 1) * group_size)
            wg = w[row, cols].double()
            top = float(wg.abs().max())
            errors = []
            for r in ratios:
                m = top * r
                c = wg.clamp(-m, m)
                low, high = min(float(c.min()), 0.0), max(float(c.max()), 0.0)
                scale = max((high - low) / 15, 2.0**-14)
                scale = float(torch.tensor(scale).half().float())
                zero = min(max(round(-low / scale), 0), 15)
                q = (torch.round(c / scale) + zero).clamp(0, 15)
                d = wg - scale * (q - zero)
                errors.append(float(((x[:, cols].double() @ d) ** 2).sum()))
            best[row, g] = top * ratios[min(range(len(ratios)), key=errors.__getitem__)]
    return best


@given(n=st.integers(1, 6), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_clipping_search_picks_the_range_the_definition_does(n, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    k = 32 * groups
    x = activations(64, k, 2, gen)
    w = torch.randn(n, k, generator=gen) * 0.1
    w[:, 0] *= 6  # one large weight per row: a range worth clipping
    hessian = 2 * x.T @ x / x.shape[0]
    max_val, err = awq_clip_search(w, hessian, int4_spec(32))
    ratios = [1 - i / 20 for i in range(10)]
    expected = clip_oracle(x, w, 32, ratios)
    torch.testing.assert_close(max_val.double(), expected, rtol=1e-5, atol=1e-7)
    # never worse than no clipping, on the data it was chosen on
    _, unclipped = awq_clip_search(w, hessian, int4_spec(32), max_shrink=0.05)
    assert bool((err <= unclipped * (1 + 1e-6)).all())


def test_clipping_shrinks_an_isolated_outlier_weight():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=gen)
    w = torch.randn(4, 32, generator=gen) * 0.05
    w[:, 3] = 1.0  # one weight 20x the rest: the grid spends most codes on it ...
    x[:, 3] *= 0.02  # ... and its input is small, so clipping it costs little output error
    hessian = 2 * x.T @ x / 256
    max_val, _ = awq_clip_search(w, hessian, int4_spec(32))
    assert bool((max_val < 0.99).all())
    linear = torch.nn.Linear(32, 4, bias=False)
    linear.weight.data = w.clone()
    clip_weights(linear, max_val)
    assert torch.equal(linear.weight.abs().amax(dim=1), max_val[:, 0])
