"""Tiny random Llama checkpoints for the speculative-decoding tests (built offline).

`build_llama(out, vocab_size, seed)` writes a random 2-layer Llama with a word-level tokenizer
of `vocab_size` tokens; `perturbed_copy` writes a draft that is the target with noise added to
its weights, so that it agrees with the target often but not always (mixed acceptance).
"""

from __future__ import annotations

import json
import pathlib

import tokenizers
import torch

EOS = 1


def write_word_tokenizer(out: pathlib.Path, vocab_size: int) -> None:
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


def build_llama(
    out: pathlib.Path,
    vocab_size: int,
    seed: int,
    hidden_size: int = 32,
    num_layers: int = 2,
    initializer_range: float = 0.3,
    max_position_embeddings: int = 256,
):
    """A random float32 Llama in `out`; returns the transformers model (the oracle)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=0,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_word_tokenizer(out, vocab_size)
    return model


def perturbed_copy(model, out: pathlib.Path, noise: float, seed: int, vocab_size: int):
    """Save `model` with Gaussian noise of relative size `noise` added to every weight."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in draft.parameters():
            weight += noise * weight.std() * torch.randn(weight.shape, generator=generator)
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out)
    write_word_tokenizer(out, vocab_size)
    return draft


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson's chi-square test of observed `counts` against exact `probs` (same shape,
    flattened): cells expected below `min_expected` are pooled into one. Returns the p-value
    (the chi-square survival function, as the regularized upper incomplete gamma)."""
    counts = counts.flatten().double()
    probs = probs.flatten().double()
    if counts[probs == 0].sum() > 0:
        return 0.0  # a token the target never emits was emitted
    total = counts.sum()
    expected = probs * total
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2))
