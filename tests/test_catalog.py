"""The model catalog: configs as in each model's config.json, found by short name or HF id."""

import pytest

from minillm.lab.catalog import HF_CONFIGS, SHORT_NAMES, get_model_config, model_names
from minillm.model.config import ModelConfig


@pytest.mark.parametrize(
    "name, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, tied",
    [
        ("Llama 3.1 8B", 32, 4096, 32, 8, 128, 14336, 128256, False),
        ("Llama 3.3 70B", 80, 8192, 64, 8, 128, 28672, 128256, False),
        ("Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, True),
        ("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, False),
        ("Mistral 7B", 32, 4096, 32, 8, 128, 14336, 32768, False),
    ],
)
def test_shapes(name, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, tied):
    c = get_model_config(name)
    got = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
           c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings)  # fmt: skip
    assert got == (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, tied)


def test_family_switches():
    assert get_model_config("Qwen3-8B").qk_norm
    assert not get_model_config("Llama 3.1 8B").qk_norm
    assert get_model_config("Llama 3.1 8B").rope_scaling["rope_type"] == "llama3"
    assert get_model_config("Llama 3.3 70B").rope_theta == 500000.0
    assert get_model_config("Mistral 7B").rope_scaling is None


@pytest.mark.parametrize("name", model_names())
def test_short_names_and_hub_ids_give_the_same_config(name):
    config = get_model_config(name)
    assert isinstance(config, ModelConfig)
    assert get_model_config(SHORT_NAMES[name]) == config
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def test_every_hub_id_has_a_short_name():
    assert sorted(SHORT_NAMES.values()) == sorted(HF_CONFIGS)


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown model 'GPT-2'.*Llama 3.1 8B"):
        get_model_config("GPT-2")
