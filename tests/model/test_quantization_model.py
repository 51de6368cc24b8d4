"""quantize_model on whole models: what it replaces, what it keeps, its options, and what
quantization costs in perplexity on the bundled model."""

import copy
import json

import pytest
import torch
from quant_testing import tiny_model
from torch import nn

from minillm.model.loader import BUNDLED_MODELS_DIR, load_model
from minillm.model.perplexity import heldout_windows, perplexity
from minillm.model.quantization import (
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    check_quantization_args,
    default_calibration,
    quantize_model,
    weight_bytes,
)
from minillm.model.quantization.calibration import calibration_files
from minillm.model.quantization.quantize import LINEAR_NAMES

TARGET = BUNDLED_MODELS_DIR / "minillm-stdlib-target"
LAYER_TYPES = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}


def float_copy(model: nn.Module) -> nn.Module:
    """The oracle model: a copy with every quantized layer replaced by an nn.Linear holding
    its dequantized weight."""
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            linear = nn.Linear(module.in_features, module.out_features, module.bias is not None)
            linear.weight.data = module.dequantize()
            if module.bias is not None:
                linear.bias.data = module.bias.float()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_rtn_replaces_the_decoder_linears_and_keeps_the_rest(quantization):
    model = tiny_model()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = model.forward_causal(ids)
    float_bytes = weight_bytes(model)
    assert quantize_model(model, quantization, group_size=32) is model
    for layer in model.model.layers:
        for name in LINEAR_NAMES:
            assert type(layer.get_submodule(name)) is LAYER_TYPES[quantization]
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding

    logits = model.forward_causal(ids)
    error = (logits - reference).norm() / reference.norm()
    assert 0 < error < {"int8": 0.03, "fp8": 0.1, "int4": 0.3}[quantization]
    # the oracle: the same model with each layer's dequantized weight in an nn.Linear
    torch.testing.assert_close(logits, float_copy(model).forward_causal(ids))

    # bytes: the float linears (7 per layer) are gone, the quantized ones counted instead
    linear_params = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    if quantization != "int4":  # 1 byte per weight, a float32 scale per output channel
        quantized = linear_params + 4 * 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)
        assert weight_bytes(model) == float_bytes - 4 * linear_params + quantized


def test_int4_bytes_are_half_a_byte_per_weight_plus_scales_and_zeros():
    model = tiny_model()
    float_bytes = weight_bytes(model)
    quantize_model(model, "int4", group_size=32)
    weights = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # 2 layers of 7 linears
    groups = weights // 32
    # float32 scales (the model's dtype), int8 zero points
    assert weight_bytes(model) == float_bytes - 4 * weights + weights // 2 + 4 * groups + groups


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_calibrated_methods_run_on_a_model(method, quantization, calibration):
    model = tiny_model(num_key_value_heads=4)  # no GQA: AWQ folds into v_proj too
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = model.forward_causal(ids)
    quantize_model(model, quantization, 32, method, calibration, act_order=True)
    logits = model.forward_causal(ids)
    assert (logits - reference).norm() / reference.norm() < 0.5  # quality: see the next test
    torch.testing.assert_close(logits, float_copy(model).forward_causal(ids))


def test_bad_options_are_refused(calibration):
    with pytest.raises(ValueError, match="quantization must be"):
        check_quantization_args("int3", 128, "rtn")
    with pytest.raises(ValueError, match="method must be"):
        check_quantization_args("int4", 128, "hqq")
    with pytest.raises(ValueError, match="takes method"):
        check_quantization_args("int4", 128, "smoothquant")
    with pytest.raises(ValueError, match="fp8"):
        check_quantization_args("fp8", 128, "gptq")
    for bad in (48, 0, True, "128"):
        with pytest.raises(ValueError, match="group_size"):
            check_quantization_args("int4", bad, "rtn")
    model = tiny_model()
    with pytest.raises(ValueError, match="does not divide"):
        quantize_model(model, "int4", group_size=128)  # hidden size 64
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_model(tiny_model(), "int4", 32, "gptq")
    quantized = quantize_model(tiny_model(), "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(quantized, "int8")


def test_default_calibration_reads_the_training_corpus_not_the_heldout_files():
    heldout = json.loads((TARGET / "heldout_tokens.json").read_text())
    files = calibration_files(TARGET)
    names = {p.as_posix() for p in files}
    assert not any(
        name.endswith("/" + held) for held in heldout["validation_files"] for name in names
    )
    windows = default_calibration(TARGET, num_tokens=1000, seq_len=100)
    assert windows.shape == (10, 100) and windows.dtype == torch.int64
    assert 0 <= int(windows.min()) and int(windows.max()) < 4096
    assert torch.equal(windows, default_calibration(TARGET, num_tokens=1000, seq_len=100))
    heldout_rows = {tuple(w[:100]) for w in heldout["token_ids"]}
    assert not any(tuple(w.tolist()) in heldout_rows for w in windows)
    with pytest.raises(ValueError, match="num_tokens"):
        default_calibration(TARGET, num_tokens=0)


@pytest.mark.slow
def test_on_the_bundled_model_gptq_and_awq_lose_less_perplexity_than_rtn():
    windows = heldout_windows(TARGET)[:8]
    calibration = default_calibration(TARGET, num_tokens=2048)
    results = {}
    for method in ("none", "rtn", "gptq", "awq"):
        model = load_model("minillm-stdlib-target", dtype="float32").model
        if method != "none":
            quantize_model(model, "int4", 128, method, calibration)
        results[method] = perplexity(model, windows)
    assert results["none"] < results["gptq"] < results["rtn"]
    assert results["none"] < results["awq"] < results["rtn"]


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_cuda_kernels_compute_what_the_cpu_path_computes(quantization):
    model = tiny_model()
    quantize_model(model, quantization, group_size=32)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    cpu = model.half().forward_causal(ids)
    cuda = model.cuda().forward_causal(ids.cuda()).cpu()
    torch.testing.assert_close(cuda, cpu, atol=2e-2, rtol=2e-2)


def test_bfloat16_layers_choose_codes_for_the_scales_they_store():
    model = tiny_model().to(torch.bfloat16)
    weight = model.model.layers[0].mlp.up_proj.weight.detach().float().clone()
    quantize_model(model, "int4", group_size=32)
    layer = model.model.layers[0].mlp.up_proj
    assert layer.scales.dtype == torch.bfloat16
    scales = layer.scales.T.float()
    assert torch.equal(scales.half().float(), scales)  # float16 values too: checkpoints hold them
    expand = scales.repeat_interleave(32, dim=1)
    zeros = layer.zeros().float().repeat_interleave(32, dim=1)
    nearest = torch.clamp(torch.round(weight / expand) + zeros, 0, 15)
    assert torch.equal(layer.codes().float(), nearest)
