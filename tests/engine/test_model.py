"""The minillm decoder against `transformers`' logits, without and with the paged KV cache."""

from __future__ import annotations

import json
import pathlib

import pytest
import safetensors.torch
import torch

from minillm.config import ModelConfig
from minillm.model import LlamaForCausalLM

ARCHS = ["llama", "qwen2", "qwen3"]
ATOL = 1e-4


def load_minillm(path: pathlib.Path) -> LlamaForCausalLM:
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    model = LlamaForCausalLM(config).eval()
    state = safetensors.torch.load_file(path / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied checkpoint stores the shared matrix once, as the embedding
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else [])
    assert unexpected == []
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_causal_matches_transformers(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    model = load_minillm(path)
    input_ids = torch.randint(
        0, hf.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(input_ids).logits
        actual = model.forward_causal(input_ids)
    assert actual.dtype == torch.float32
    assert actual.shape == (3, 40, hf.config.vocab_size)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
