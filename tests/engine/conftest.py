"""Tiny random Hugging Face checkpoints built by `transformers` itself (no downloads).

`transformers` is the logits oracle: a checkpoint written by its `save_pretrained` must
load in minillm and give the same logits.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import tokenizers
import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that the three frequency bands all occur with head_dim 16
    "original_max_position_embeddings": 32,
}

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES = {
    # Llama 3.1 style: llama3 rope_scaling, untied embeddings
    "llama": dict(rope_scaling=LLAMA3_ROPE, rope_theta=10000.0, tie_word_embeddings=False),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    # Qwen3: q/k norm, head_dim (24) != hidden_size / num_heads (16)
    "qwen3": dict(head_dim=24, rope_theta=1000000.0, tie_word_embeddings=False),
}


def build_hf_model(arch: str, seed: int = 0, **overrides):
    """A random float32 `transformers` model of family `arch` ("llama", "qwen2", "qwen3")."""
    import transformers

    kwargs = {**COMMON, **ARCHITECTURES[arch], **overrides}
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():
        # transformers initializes norms to 1 and biases to 0; make both matter
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def write_word_tokenizer(out: pathlib.Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer.json with tokens <s>=1 and </s>=2 named as bos/eos."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture
def hf_checkpoint(tmp_path: pathlib.Path):
    """Factory: save a random `transformers` model and a tokenizer to a directory;
    returns (dir, hf_model). Extra keyword arguments override the config."""

    def make(arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
        model = build_hf_model(arch, seed, **overrides)
        out = tmp_path / f"{arch}-{seed}"
        if max_shard_size is None:
            model.save_pretrained(out)
        else:
            model.save_pretrained(out, max_shard_size=max_shard_size)
        write_word_tokenizer(out, model.config.vocab_size)
        return out, model

    return make
