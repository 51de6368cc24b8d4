"""The public GPTQ and AWQ checkpoint layouts: bit packing against the documented formats
written out as loops, and whole checkpoints written, read back, and compared logit for logit."""

import json

import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st
from quant_testing import tiny_model

from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.model.loader import (
    BUNDLED_MODELS_DIR,
    check_state_dict,
    load_model,
    load_safetensors,
)
from minillm.model.quantization import Int4Linear, quantize_model
from minillm.model.quantization.checkpoint import (
    AWQ_ORDER,
    load_quantized_linears,
    pack_nibbles,
    read_layer,
    read_quantization_config,
    save_quantized,
    unpack_nibbles,
)
from minillm.model.quantization.linear import linear_layers

TARGET = BUNDLED_MODELS_DIR / "minillm-stdlib-target"


def load_quantized_dir(path, dtype=torch.float32):
    """What `load_model` does with a quantized directory once the loader is wired
    (`load_quantized_linears` before the state dict check)."""
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf_config(hf_config)
    config.torch_dtype = str(dtype).removeprefix("torch.")
    state = load_safetensors(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = load_quantized_linears(model, state, hf_config["quantization_config"], dtype, "cpu")
    check_state_dict(model, state, path)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def as_int32(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


@given(
    rows=st.integers(1, 5),
    words=st.integers(1, 4),
    awq=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packing_matches_the_documented_bit_layout(rows, words, awq, seed):
    values = torch.randint(0, 16, (rows, 8 * words), generator=torch.Generator().manual_seed(seed))
    order = AWQ_ORDER if awq else tuple(range(8))
    packed = pack_nibbles(values, order)
    for r in range(rows):
        for c in range(words):
            word = sum(int(values[r, 8 * c + order[i]]) << (4 * i) for i in range(8))
            assert int(packed[r, c]) == as_int32(word)
    assert packed.dtype == torch.int32
    assert torch.equal(unpack_nibbles(packed, order), values.int())


def gptq_layer_by_hand(codes, scales, zeros, g_idx, v1=True):
    """A GPTQ layer's tensors as AutoGPTQ's pack loops write them: codes [K, N], scales and
    zeros [G, N], g_idx [K]."""
    k, n = codes.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    for r in range(k // 8):
        for col in range(n):
            word = sum(int(codes[8 * r + j, col]) << (4 * j) for j in range(8))
            qweight[r, col] = as_int32(word)
    stored = zeros - 1 if v1 else zeros
    qzeros = torch.zeros(zeros.shape[0], n // 8, dtype=torch.int32)
    for g in range(zeros.shape[0]):
        for c in range(n // 8):
            qzeros[g, c] = as_int32(sum(int(stored[g, 8 * c + j]) << (4 * j) for j in range(8)))
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.half(), "g_idx": g_idx}


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_a_hand_written_gptq_layer_reads_back_as_its_weights(act_order, v1):
    gen = torch.Generator().manual_seed(0)
    k, n, g = 64, 16, 32
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(k // g, n, generator=gen) * 0.01 + 0.001).half().float()
    zeros = torch.randint(1, 16, (k // g, n), generator=gen)
    g_idx = torch.arange(k, dtype=torch.int32) // g
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    tensors = gptq_layer_by_hand(codes, scales, zeros, g_idx, v1)
    layer = read_layer("gptq", tensors, k, n, g, "gptq" if v1 else "gptq_v2", None,
                       torch.float32, "q_proj")  # fmt: skip
    expected = torch.empty(n, k)
    for channel in range(k):
        group = int(g_idx[channel])
        expected[:, channel] = scales[group] * (codes[channel].float() - zeros[group].float())
    torch.testing.assert_close(layer.dequantize(), expected, atol=0, rtol=0)
    assert (layer.input_perm is not None) == act_order


def test_a_hand_written_awq_layer_reads_back_as_its_weights():
    gen = torch.Generator().manual_seed(0)
    k, n, g = 64, 16, 32
    codes = torch.randint(0, 16, (k, n), generator=gen)  # [K, N], as AutoAWQ's intweight
    scales = (torch.rand(k // g, n, generator=gen) * 0.01 + 0.001).half().float()
    zeros = torch.randint(0, 16, (k // g, n), generator=gen)

    def pack(values):  # AutoAWQ's loop: nibble i of column c holds column 8c + order_map[i]
        out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
        for row in range(values.shape[0]):
            for c in range(values.shape[1] // 8):
                word = sum(int(values[row, 8 * c + AWQ_ORDER[i]]) << (4 * i) for i in range(8))
                out[row, c] = as_int32(word)
        return out

    tensors = {"qweight": pack(codes), "qzeros": pack(zeros), "scales": scales.half()}
    layer = read_layer("awq", tensors, k, n, g, "awq", None, torch.float32, "up_proj")
    expected = torch.empty(n, k)
    for channel in range(k):
        group = channel // g
        expected[:, channel] = scales[group] * (codes[channel].float() - zeros[group].float())
    torch.testing.assert_close(layer.dequantize(), expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "checkpoint_format, dtype",
    [("gptq", torch.float32), ("gptq_v2", torch.float32), ("awq", torch.float32),
     ("gptq", torch.bfloat16)],
)  # fmt: skip
def test_the_bundled_model_round_trips_through_each_layout(tmp_path, checkpoint_format, dtype):
    loaded = load_model("minillm-stdlib-target", dtype=dtype)
    quantize_model(loaded.model, "int4", group_size=128)
    out = save_quantized(loaded.model, loaded.config, TARGET, tmp_path, checkpoint_format)
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["quantization_config"]["quant_method"] == checkpoint_format[:4].rstrip("_")
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    names = safetensors.torch.load_file(out / "model.safetensors").keys()
    assert "model.layers.0.mlp.down_proj.qweight" in names
    assert "model.layers.0.mlp.down_proj.weight" not in names

    reloaded = load_quantized_dir(out, dtype)
    for name, layer in linear_layers(reloaded).items():
        original = loaded.model.get_submodule(name)
        assert torch.equal(layer.packed, original.packed)
        assert torch.equal(layer.scales, original.scales)
    ids = torch.tensor(json.loads((TARGET / "heldout_tokens.json").read_text())["token_ids"][:2])
    with torch.no_grad():
        assert torch.equal(reloaded.forward_causal(ids), loaded.model.forward_causal(ids))


def test_symmetric_and_act_order_layers_round_trip_through_gptq(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    quantize_model(model, "int4", group_size=32)
    gen = torch.Generator().manual_seed(0)
    for i, name in enumerate(["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]):
        old = model.get_submodule(name)
        perm = torch.randperm(old.in_features, generator=gen) if i == 0 else None
        new = Int4Linear(old.codes(), old.scales.T, None, 32, None, torch.float32, perm)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    config = model.config
    out = save_quantized(model, config, TARGET, tmp_path, "gptq")
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["desc_act"] is True and quant["sym"] is False
    reloaded = load_quantized_dir(out)
    ids = torch.randint(0, 128, (2, 10), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.forward_causal(ids), model.forward_causal(ids))
    assert reloaded.model.layers[1].mlp.down_proj.zero_points is None
    with pytest.raises(ValueError, match="input permutation"):
        save_quantized(model, config, TARGET, tmp_path / "awq", "awq")


def test_unsupported_checkpoints_and_models_are_refused(tmp_path):
    for bad, message in [
        ({"quant_method": "bitsandbytes"}, "unsupported quant_method"),
        (["gptq"], "JSON object"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "only 4-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemm"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
    ]:
        with pytest.raises(ValueError, match=message):
            read_quantization_config(bad)
    assert read_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64}) == (
        "awq",
        64,
        "awq",
    )
    model = tiny_model()
    with pytest.raises(ValueError, match="Int4Linear"):
        save_quantized(model, model.config, TARGET, tmp_path, "gptq")
    quantize_model(model, "int4", group_size=32)
    layer = model.model.layers[0].mlp.up_proj
    codes, zeros = layer.codes(), layer.zeros()
    zeros[0, 0] = 0
    model.model.layers[0].mlp.up_proj = Int4Linear(
        codes, layer.scales.T, zeros, 32, None, torch.float32
    )
    with pytest.raises(ValueError, match="gptq_v2"):
        save_quantized(model, model.config, TARGET, tmp_path, "gptq")
    save_quantized(model, model.config, TARGET, tmp_path, "gptq_v2")  # v2 stores z as is


def test_a_checkpoint_with_wrong_shapes_is_refused(tmp_path):
    model = tiny_model()
    quantize_model(model, "int4", group_size=32)
    out = save_quantized(model, model.config, TARGET, tmp_path, "awq")
    state = safetensors.torch.load_file(out / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.scales"] = torch.zeros(3, 32, dtype=torch.float16)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    with torch.device("meta"):
        fresh = LlamaForCausalLM(model.config)
    with pytest.raises(ValueError, match="k_proj.scales has shape"):
        load_quantized_linears(fresh, state, quant, torch.float32, "cpu")


def test_load_model_reads_a_quantized_directory(tmp_path):
    loaded = load_model("minillm-stdlib-target", dtype="float32")
    quantize_model(loaded.model, "int4", group_size=128)
    save_quantized(loaded.model, loaded.config, TARGET, tmp_path, "gptq")
    reloaded = load_model(tmp_path, dtype="float32")
    ids = torch.tensor([[0, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(reloaded.model.forward_causal(ids), loaded.model.forward_causal(ids))
