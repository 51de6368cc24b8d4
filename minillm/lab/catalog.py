"""Configurations of well-known open models, for calculations without their weights.

The book sizes real models (bytes of weights and KV cache, FLOPs per step, bandwidth
floors) from their shapes alone, and shapes are what `config.json` holds. Each entry
below copies the fields `ModelConfig` reads from the model's Hugging Face
`config.json`, value for value, and builds the config through
`ModelConfig.from_hf_config`, the same path a downloaded checkpoint takes.

Mistral 7B v0.3 is a `MistralForCausalLM` in its config.json. With `sliding_window`
null, as in v0.3, that architecture has the same tensors and the same computation as
`LlamaForCausalLM`, so the entry is read as a Llama.
"""

from __future__ import annotations

from minillm.model.config import ModelConfig

_LLAMA3_ROPE_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

# The fields of each model's config.json that ModelConfig reads.
HF_CONFIGS: dict[str, dict] = {
    "meta-llama/Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE_SCALING,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    "meta-llama/Llama-3.3-70B-Instruct": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE_SCALING,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "mistralai/Mistral-7B-Instruct-v0.3": {
        # config.json says MistralForCausalLM; with no sliding window it is a Llama.
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}

# Short names used in the book's prose and widgets.
SHORT_NAMES = {
    "Llama 3.1 8B": "meta-llama/Llama-3.1-8B-Instruct",
    "Llama 3.3 70B": "meta-llama/Llama-3.3-70B-Instruct",
    "Qwen3-0.6B": "Qwen/Qwen3-0.6B",
    "Qwen3-8B": "Qwen/Qwen3-8B",
    "Mistral 7B": "mistralai/Mistral-7B-Instruct-v0.3",
}


def model_names() -> list[str]:
    """The short names `get_model_config` accepts (Hugging Face ids work too)."""
    return list(SHORT_NAMES)


def get_model_config(name: str) -> ModelConfig:
    """The `ModelConfig` of a catalog model, by short name ("Llama 3.1 8B") or HF id."""
    hf_id = SHORT_NAMES.get(name, name)
    if hf_id not in HF_CONFIGS:
        raise ValueError(
            f"unknown model {name!r}; expected one of {model_names()} or {list(HF_CONFIGS)}"
        )
    return ModelConfig.from_hf_config(HF_CONFIGS[hf_id])
