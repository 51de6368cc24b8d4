"""W8A8 (int8 weights per channel, int8 activations per token) and SmoothQuant: the layer
against a plain int64 oracle, the Triton kernel path against the PyTorch one, smoothing's
folds, its effect on outlier channels, and the engine serving a W8A8 model."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from quant_testing import tiny_model

from minillm.llm import LLM
from minillm.model.loader import load_model
from minillm.model.perplexity import heldout_windows
from minillm.model.quantization import W8A8Linear, check_quantization_args, quantize_model
from minillm.model.quantization.quantize import LINEAR_NAMES
from minillm.model.quantization.smoothquant import apply_smoothquant, smoothquant_factors


def oracle_w8a8(x, w, smooth=None):
    """W8A8 written out: smooth, per-token and per-channel int8 codes, an int64 product,
    the scales last (float64)."""
    x, w = x.double(), w.double()
    if smooth is not None:
        x, w = x / smooth.double(), w * smooth.double()
    sx = x.abs().max(dim=1).values / 127
    sw = w.abs().max(dim=1).values / 127
    qx = torch.round(x / torch.where(sx == 0, 1, sx)[:, None]).long()
    qw = torch.round(w / sw[:, None]).long()
    return (qx @ qw.T).double() * sx[:, None] * sw[None, :]


def w8a8_layer(w, bias=None, smooth=None):
    """A W8A8Linear holding w (times smooth) with float32 per-channel scales."""
    ws = w if smooth is None else w * smooth
    scales = ws.abs().amax(dim=1) / 127
    codes = torch.round(ws / scales[:, None])
    return W8A8Linear(codes, scales, bias, torch.float32, smooth)


@given(
    m=st.integers(1, 24),
    n=st.integers(1, 40),
    k=st.integers(1, 96),
    seed=st.integers(0, 2**16),
    smoothed=st.booleans(),
)
def test_w8a8_layer_matches_the_int64_oracle(m, n, k, seed, smoothed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.1
    smooth = torch.rand(k, generator=gen) + 0.5 if smoothed else None
    layer = w8a8_layer(w, smooth=smooth)
    expected = oracle_w8a8(x, w, smooth)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # same integers; the float32 epilogue against the float64 one (and an input scale or a
    # code that lands on a rounding tie the other way: one code of one product)
    tol = 1e-5 * float(expected.abs().max()) + 2 * float(
        (x.abs().amax(1).max() / 127) * (w.abs().amax(1).max() / 127)
    ) * (1 if smooth is None else float(smooth.max() / smooth.min()))
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=0)


@given(m=st.integers(1, 20), n=st.integers(1, 40), k=st.integers(1, 80), seed=st.integers(0, 999))
def test_the_kernel_path_computes_what_the_torch_path_does(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    layer = w8a8_layer(torch.randn(n, k, generator=gen) * 0.1, bias=torch.randn(n))
    torch.testing.assert_close(layer.forward_kernel(x), layer.forward_torch(x))


def test_w8a8_layer_checks_its_inputs():
    with pytest.raises(ValueError, match="int8 codes"):
        W8A8Linear(torch.full((2, 3), 128), torch.ones(2), None, torch.float32)
    with pytest.raises(ValueError, match="input_smooth"):
        W8A8Linear(torch.ones(2, 3), torch.ones(2), None, torch.float32, torch.zeros(3))


def outlier_case(seed=0, tokens=256, k=128, n=64, outliers=(5, 77), size=60.0):
    """Activations with a few input channels tens of times larger than the rest in every
    token (as in LLMs' layer inputs) and ordinary weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen)
    x[:, list(outliers)] *= size
    w = torch.randn(n, k, generator=gen) * 0.05
    return x, w


def relative_error(y, x, w):
    exact = x.double() @ w.double().T
    return float((y.double() - exact).norm() / exact.norm())


def test_smoothquant_lowers_w8a8_error_on_outlier_channels():
    x, w = outlier_case()
    plain = relative_error(w8a8_layer(w)(x), x, w)
    s = smoothquant_factors(x.abs().amax(dim=0), [w], alpha=0.5)
    smoothed = relative_error(w8a8_layer(w, smooth=s)(x), x, w)
    # without smoothing the outliers set every token's scale and the other channels keep a
    # few codes each; with it the range is shared between activations and weights
    assert smoothed < plain / 3, (plain, smoothed)
    # without outliers there is little to gain (and nothing much to lose)
    x0, w0 = outlier_case(size=1.0)
    s0 = smoothquant_factors(x0.abs().amax(dim=0), [w0], alpha=0.5)
    plain0 = relative_error(w8a8_layer(w0)(x0), x0, w0)
    assert relative_error(w8a8_layer(w0, smooth=s0)(x0), x0, w0) < 1.5 * plain0
    assert plain0 < plain / 2  # the outliers are what made the plain layer worse


def test_smoothquant_factors_follow_the_formula():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w1 = torch.tensor([[1.0, -0.25, 0.5, 0.0], [0.5, 0.5, -2.0, 0.0]])
    w2 = torch.tensor([[-4.0, 0.25, 0.5, 0.0]])
    s = smoothquant_factors(act, [w1, w2], alpha=0.5)
    # max |W_j| over both layers: 4, 0.5, 2, 0 (clamped at 1e-5); act 0 clamped at 1e-5
    expected = torch.tensor(
        [(4 / 4) ** 0.5, (1 / 0.5) ** 0.5, (1e-5 / 2) ** 0.5, (9 / 1e-5) ** 0.5]
    )
    torch.testing.assert_close(s, expected)
    torch.testing.assert_close(
        smoothquant_factors(act, [w1, w2], 0.0), 1 / torch.tensor([4.0, 0.5, 2.0, 1e-5])
    )
    with pytest.raises(ValueError, match="alpha"):
        smoothquant_factors(act, [w1], 1.5)
    with pytest.raises(ValueError, match="weights"):
        smoothquant_factors(act, [w1[:, :3]], 0.5)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_smoothing_folds_leave_the_float_model_unchanged(kv_heads):
    """Folded into the norms and the linears before (and, under GQA, o_proj's input divided
    by its factors), the smoothed float model computes the same logits."""
    model = tiny_model(num_key_value_heads=kv_heads)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = model.forward_causal(ids)
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        amax = {
            name: torch.rand(layer.get_submodule(name).in_features, generator=gen) * 10 + 0.1
            for name in LINEAR_NAMES
        }
        unfolded = apply_smoothquant(layer, amax, 0.5)
        assert set(unfolded) == (set() if kv_heads == 4 else {"self_attn.o_proj"})
        for name, s in unfolded.items():
            layer.get_submodule(name).register_forward_pre_hook(
                lambda m, inputs, s=s: (inputs[0] / s,)
            )
        assert not torch.allclose(layer.input_layernorm.weight, torch.ones(64))
    torch.testing.assert_close(model.forward_causal(ids), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["rtn", "smoothquant"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_quantize_model_w8a8(method, kv_heads, calibration):
    model = tiny_model(num_key_value_heads=kv_heads)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.forward_causal(ids)
    quantize_model(model, "w8a8", method=method, calibration=calibration)
    for layer in model.model.layers:
        for name in LINEAR_NAMES:
            linear = layer.get_submodule(name)
            assert type(linear) is W8A8Linear
            smoothed_input = method == "smoothquant" and kv_heads == 2 and name.endswith("o_proj")
            assert (linear.input_smooth is not None) == smoothed_input
    with torch.no_grad():
        logits = model.forward_causal(ids)
    assert 0 < float((logits - reference).norm() / reference.norm()) < 0.05


def test_w8a8_options_are_checked():
    check_quantization_args("w8a8", 128, "smoothquant")
    with pytest.raises(ValueError, match="takes method"):
        check_quantization_args("w8a8", 128, "gptq")
    with pytest.raises(ValueError, match="takes method"):
        check_quantization_args("int4", 128, "smoothquant")


@pytest.fixture(scope="module")
def bundled_logits():
    """float32 logits of the bundled target on 4 held-out windows, and the windows."""
    loaded = load_model("minillm-stdlib-target", dtype="float32")
    windows = heldout_windows(loaded.path)[:4, :128]
    with torch.no_grad():
        return windows, loaded.model.forward_causal(windows)


@pytest.mark.parametrize("method", ["rtn", "smoothquant"])
def test_the_engine_serves_w8a8_close_to_float32(method, bundled_logits):
    windows, reference = bundled_logits
    llm = LLM(
        "minillm-stdlib-target",
        dtype="float32",
        device="cpu",
        num_gpu_blocks=64,
        quantization="w8a8",
        quantization_method=method,
    )
    model = llm.engine.model_runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, W8A8Linear)
    with torch.no_grad():
        logits = model.forward_causal(windows)
    error = float((logits - reference).norm() / reference.norm())
    agree = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    assert 0 < error < 0.05, error
    assert agree > 0.95, agree


def test_before_ampere_the_layer_sums_the_same_integers_without_the_kernel(monkeypatch):
    from kernels import int8_gemm

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 48, generator=gen)
    layer = w8a8_layer(torch.randn(9, 48, generator=gen) * 0.1)
    monkeypatch.setattr(int8_gemm, "supported", lambda device: False)
    torch.testing.assert_close(layer.forward_kernel(x), layer.forward_torch(x))
    qx, sx = int8_gemm.quantize_per_token(x)
    with pytest.raises(ValueError, match="compute capability 8.0"):
        int8_gemm.w8a8_matmul(qx, sx, layer.qweight, layer.scales)
