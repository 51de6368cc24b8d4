"""xgrammar as the oracle of the token masks: its tokenizer setup, its mask of one state, and
random walks that compare minillm's mask with xgrammar's at every step. A grammar is a
regex (a string) or a compiled context-free grammar (which carries its `source`)."""

from __future__ import annotations

import random

import pytest
import torch

from minillm.model.loader import DEFAULT_MODEL, resolve_model_path
from minillm.model.tokenizer import Tokenizer
from minillm.structured.grammar import StructuredOutputManager, token_bytes

xgr = pytest.importorskip("xgrammar")


def xgrammar_setup():
    """(tokenizer, xgrammar's compiler, minillm's manager) for the bundled model."""
    tokenizer = Tokenizer(resolve_model_path(DEFAULT_MODEL))
    vocab_size = tokenizer.vocab_size
    encoded = [data or b"" for data in token_bytes(tokenizer, vocab_size)]
    info = xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    return tokenizer, xgr.GrammarCompiler(info), StructuredOutputManager(tokenizer, vocab_size)


def xgrammar_mask(matcher, vocab_size: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    ids = torch.arange(vocab_size)
    return ((bitmask[0][ids // 32] >> (ids % 32)) & 1).bool()


def compare_walks(
    setup, grammar, compiled, num_walks: int = 3, max_steps: int = 12, avoid: bytes = b""
) -> int:
    """Walk random allowed tokens (none whose bytes hold `avoid`, when given) and assert that
    our mask equals xgrammar's at every state, EOS included; returns how many states were
    compared."""
    tokenizer, _, manager = setup
    vocab = token_bytes(tokenizer, tokenizer.vocab_size)
    vocab_size, eos = tokenizer.vocab_size, tokenizer.eos_token_id
    key = getattr(grammar, "source", grammar)
    rng = random.Random(key)
    compared = 0
    for walk in range(num_walks):
        matcher = xgr.GrammarMatcher(compiled)
        request_id = f"{key}/{walk}"
        output: list[int] = []
        for _ in range(max_steps):
            ours = manager.allowed_mask(request_id, grammar, output, [eos])
            theirs = xgrammar_mask(matcher, vocab_size)
            different = (ours != theirs).nonzero().flatten().tolist()
            assert different == [], (tokenizer.decode(output), different[:10])
            compared += 1
            choices = [
                t
                for t in ours.nonzero().flatten().tolist()
                if t != eos and not (avoid and avoid in vocab[t])
            ]
            if not choices:
                break
            token = rng.choice(choices)
            assert matcher.accept_token(token)
            output.append(token)
        manager.free(request_id)
    return compared
