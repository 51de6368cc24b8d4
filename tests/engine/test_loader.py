"""Loading Hugging Face-format directories, writing them back, and the errors in between."""

from __future__ import annotations

import json
import sys

import pytest
import safetensors.torch
import tokenizers
import torch

from minillm.model import loader
from minillm.model.loader import (
    DEFAULT_MODEL,
    LoadedModel,
    load_model,
    resolve_model_path,
    save_pretrained,
)

ATOL = 1e-4


def input_ids(vocab_size: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))


def assert_same_logits(loaded: LoadedModel, hf) -> None:
    with torch.no_grad():
        expected = hf(input_ids()).logits
        actual = loaded.model.forward_causal(input_ids())
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_load_model_matches_transformers(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    loaded = load_model(path)
    assert loaded.path == path
    assert loaded.config.architecture == type(hf).__name__
    assert loaded.model.lm_head.weight.dtype == torch.float32
    assert not loaded.model.training
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id) == (1, 2)
    assert loaded.generation_config["bos_token_id"] == 1
    assert loaded.eos_token_ids == loaded.config.eos_token_ids == [2]
    assert_same_logits(loaded, hf)


def test_sharded_checkpoint(hf_checkpoint):
    path, hf = hf_checkpoint("llama", max_shard_size="40KB")
    assert not (path / "model.safetensors").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    assert_same_logits(load_model(path), hf)


def test_dtype_argument_and_config_dtype(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    loaded = load_model(path, dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.config.torch_dtype == "bfloat16"
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "float16"  # transformers 5 writes "dtype", 4.x "torch_dtype"
    (path / "config.json").write_text(json.dumps(config))
    assert load_model(path).model.lm_head.weight.dtype == torch.float16
    assert load_model(path, dtype=torch.float32).model.lm_head.weight.dtype == torch.float32


def test_tied_checkpoint_with_or_without_lm_head(hf_checkpoint):
    path, hf = hf_checkpoint("qwen2")  # tied
    state = safetensors.torch.load_file(path / "model.safetensors")
    assert "lm_head.weight" not in state
    loaded = load_model(path)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert_same_logits(loaded, hf)
    # some tied checkpoints store the matrix under both names
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    safetensors.torch.save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    assert_same_logits(load_model(path), hf)


def test_eos_ids_are_the_union_of_config_and_generation_config(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3", eos_token_id=[2, 7])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    loaded = load_model(path)
    assert loaded.eos_token_ids == loaded.config.eos_token_ids == [2, 7, 5]
    assert loaded.generation_config == {"eos_token_id": [7, 5]}


def test_missing_files(hf_checkpoint):
    path, _ = hf_checkpoint("llama", max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {shard.name} listed in"):
        load_model(path)
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or model.safetensors"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="expected config.json in"):
        load_model(path)


def test_missing_tokenizer(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(path)


def test_unsupported_architecture(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'MistralForCausalLM'.*Llama"):
        load_model(path)


def test_shape_mismatch_names_the_tensor(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        load_model(path)
    message = str(info.value)
    assert "model.layers.0.mlp.gate_proj.weight" in message
    assert "(96, 64)" in message and "expected (128, 64)" in message


def test_missing_and_extra_tensors(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    state = safetensors.torch.load_file(path / "model.safetensors")
    norm = state.pop("model.norm.weight")
    safetensors.torch.save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks tensors.*\['model.norm.weight'\]"):
        load_model(path)
    state["model.norm.weight"] = norm
    state["model.layers.0.mlp.extra.weight"] = norm.clone()
    safetensors.torch.save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="does not use.*model.layers.0.mlp.extra.weight"):
        load_model(path)


def test_resolve_local_bundled_and_path_like_names(tmp_path, monkeypatch):
    assert DEFAULT_MODEL == "minillm-stdlib-target"
    assert resolve_model_path(tmp_path) == tmp_path
    (tmp_path / "tiny").mkdir()
    monkeypatch.setattr(loader, "BUNDLED_MODELS_DIR", tmp_path)
    monkeypatch.chdir(tmp_path.parent)
    assert resolve_model_path("tiny") == tmp_path / "tiny"
    with pytest.raises(FileNotFoundError, match="not a local directory, nor a bundled model"):
        resolve_model_path("./no-such-dir")


def test_offline_hub_name_gives_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # read once at import time, so the running process needs the constant too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pass a local directory.*Hugging Face Hub failed"):
        load_model("minillm-test/no-such-model")


def test_hub_name_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(FileNotFoundError, match="pass a local directory.*install huggingface_hub"):
        resolve_model_path("minillm-test/no-such-model")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_save_pretrained_round_trip_through_transformers(hf_checkpoint, tmp_path, arch):
    import transformers

    path, hf = hf_checkpoint(arch)
    loaded = load_model(path)
    out = save_pretrained(loaded.model, loaded.config, loaded.tokenizer, tmp_path / "saved")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    stored = safetensors.torch.load_file(out / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not loaded.config.tie_word_embeddings)
    assert_same_logits(load_model(out), hf)
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(reloaded_hf) is type(hf)
    assert_same_logits(loaded, reloaded_hf)


def test_save_pretrained_with_a_tokenizers_object(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("llama")
    loaded = load_model(path, dtype="bfloat16")
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    out = save_pretrained(loaded.model, loaded.config, backend, tmp_path / "saved")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    # no tokenizer_config.json came with the object: one is written from the model config
    reloaded = load_model(out)
    assert (reloaded.tokenizer.bos_token_id, reloaded.tokenizer.eos_token_id) == (1, 2)
    assert reloaded.model.lm_head.weight.dtype == torch.bfloat16
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(reloaded.model.state_dict()[name], tensor), name


def test_resolve_dtype_falls_back_to_float16_without_bfloat16(monkeypatch):
    from minillm.model.loader import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, "bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float32", "bfloat16", cpu) == torch.float32
    # a GPU without bfloat16 (compute capability < 8.0, such as a T4)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert resolve_dtype(None, "bfloat16", cuda) == torch.float16
    assert resolve_dtype(None, "float32", cuda) == torch.float32
    with pytest.raises(ValueError, match="Tesla T4 has no bfloat16 support"):
        resolve_dtype("bfloat16", "float32", cuda)


@pytest.mark.parametrize("model", ["", "   ", None, 5, ["dir"]])
def test_a_model_that_names_nothing_is_a_value_error(model):
    with pytest.raises(ValueError, match=r"^model must be a model directory, a bundled model's"):
        load_model(model)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (
            "bogus",
            r"^device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got 'bogus'$",
        ),
        (None, r"^device must be a torch device such as .* got None$"),
        ("xpu", r"^device must be 'cpu', a CUDA device such as 'cuda' or 'cuda:1', or 'mps'"),
    ],
)
def test_a_device_torch_cannot_name_is_a_value_error(device, message):
    from minillm.model.loader import resolve_device

    with pytest.raises(ValueError, match=message):
        resolve_device(device)
    with pytest.raises(ValueError, match=message):
        load_model(DEFAULT_MODEL, device=device)


def test_a_cuda_device_without_cuda_is_a_value_error(monkeypatch):
    from minillm.model.loader import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device 'cuda' asked for, but this torch sees no CUDA"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"^device 'cuda:2' asked for, but only 2 CUDA GPU"):
        resolve_device("cuda:2")
    assert resolve_device("cpu") == torch.device("cpu")
