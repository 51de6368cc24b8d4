"""A tiny random Llama checkpoint with a byte-level BPE tokenizer, for engine tests.

Built with `transformers` and `tokenizers` into a directory: no downloads. The model is small
enough that a whole engine test runs in seconds on a CPU, and its weights are large enough
(initializer_range) that greedy decoding is not a coin toss between near-equal logits.
"""

from __future__ import annotations

import json
import pathlib

import tokenizers
import torch

from minillm.lab import lora_demo

VOCAB_SIZE = 320
BOS, EOS = 0, 1
TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "def main(args): return sum(x * x for x in args)",
    "continuous batching keeps the accelerator busy",
    "a block table maps token positions to cache slots",
] * 20


def write_tokenizer(out: pathlib.Path) -> None:
    """A byte-level BPE tokenizer.json trained on a few lines, <s> = 0 and </s> = 1."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def build_tiny_llama(
    out: pathlib.Path, seed: int = 0, max_position_embeddings: int = 256, num_hidden_layers: int = 2
):
    """Write a random GQA Llama (hidden 32, 2 layers unless told) and its tokenizer to `out`."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.3,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(out)
    write_tokenizer(out)
    return out


def greedy_reference(model, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """The oracle: greedy decoding by re-running the plain causal forward on the whole
    sequence for every token. No KV cache, no batching, no scheduler."""
    token_ids = list(prompt_token_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model.forward_causal(torch.tensor([token_ids]))
            token_ids.append(int(logits[0, -1].argmax()))
    return token_ids[len(prompt_token_ids) :]


def random_lora_weights(model, targets, rank: int, seed: int) -> dict:
    """{module name: (A [r, in], B [out, r])} for every linear layer of `model` named in
    `targets`, large enough that the adapter changes greedy tokens."""
    return lora_demo.random_lora_weights(model, targets, rank, seed)
