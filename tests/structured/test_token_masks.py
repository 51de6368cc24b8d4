"""Token masks, stop tokens and jump-forward on the bundled tokenizer, checked by hand: a
token is allowed exactly when some match of the pattern starts with the text so far plus it.
"""

import re

import pytest

from minillm.model.loader import DEFAULT_MODEL, resolve_model_path
from minillm.model.tokenizer import Tokenizer
from minillm.structured.grammar import StructuredOutputManager, token_bytes


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, tokenizer.vocab_size)


def test_token_bytes_are_what_the_tokenizer_decodes(tokenizer):
    vocab = token_bytes(tokenizer, tokenizer.vocab_size)
    assert vocab[tokenizer.eos_token_id] is None and vocab[tokenizer.bos_token_id] is None
    ids = tokenizer.encode("def f(x):\n    return {'é': x}  # ok", add_special_tokens=False)
    assert b"".join(vocab[t] for t in ids).decode() == tokenizer.decode(ids)


def test_a_mask_allows_exactly_the_tokens_that_keep_a_match_possible(tokenizer, manager):
    # "(yes|no|maybe)" after "m": a token t is allowed iff "m" + text(t) is a prefix of "maybe"
    eos = tokenizer.eos_token_id
    [m] = tokenizer.encode("m", add_special_tokens=False)
    mask = manager.allowed_mask("r", "(?:yes|no|maybe)", [m], [eos])
    vocab = token_bytes(tokenizer, tokenizer.vocab_size)
    expected = {t for t, data in enumerate(vocab) if data and b"maybe".startswith(b"m" + data)}
    assert set(mask.nonzero().flatten().tolist()) == expected
    assert not mask[eos]  # "m" is no complete match


def test_stop_tokens_only_in_accepting_states_and_forced_at_the_end(tokenizer, manager):
    eos = tokenizer.eos_token_id
    pattern = "ab|abc"
    [a] = tokenizer.encode("a", add_special_tokens=False)
    [b] = tokenizer.encode("b", add_special_tokens=False)
    [c] = tokenizer.encode("c", add_special_tokens=False)
    after_a = manager.allowed_mask("r", pattern, [a], [eos])
    assert not after_a[eos] and after_a[b]
    after_ab = manager.allowed_mask("r", pattern, [a, b], [eos])
    assert after_ab[eos] and after_ab[c]  # "ab" matches, "abc" may follow
    after_abc = manager.allowed_mask("r", pattern, [a, b, c], [eos])
    assert after_abc.nonzero().flatten().tolist() == [eos]  # nothing else can follow
    # once the stop token is out, only stop tokens remain (ignore_eos keeps generating them)
    assert manager.allowed_mask("r", pattern, [a, b, c, eos], [eos]).nonzero().tolist() == [[eos]]


def test_a_token_the_grammar_forbids_is_an_error(tokenizer, manager):
    [z] = tokenizer.encode("z", add_special_tokens=False)
    with pytest.raises(ValueError, match="not allowed by the request's grammar"):
        manager.allowed_mask("r", "[0-9]+", [z], [tokenizer.eos_token_id])


def test_jump_forward_tokens_spell_the_forced_text_but_its_last_token(tokenizer, manager):
    eos = tokenizer.eos_token_id
    pattern = r'\{"identifier": "[a-z]+"\}'
    [brace] = tokenizer.encode("{", add_special_tokens=False)
    tokens = manager.jump_forward_tokens("r", pattern, [brace], [eos], max_tokens=50)
    forced = '"identifier": "'
    full = tokenizer.encode(forced, add_special_tokens=False)
    assert tokens == full[:-1] and len(tokens) >= 1
    assert forced.startswith(tokenizer.decode(tokens))
    # the jumped tokens walk the grammar: the state after them still allows the rest
    mask = manager.allowed_mask("r", pattern, [brace, *tokens], [eos])
    rest = forced[len(tokenizer.decode(tokens)) :]
    assert mask[tokenizer.encode(rest, add_special_tokens=False)[0]]
    # nothing is forced where the grammar has a choice, and max_tokens bounds the jump
    assert manager.jump_forward_tokens("s", pattern, [brace, *full], [eos], 50) == []
    assert len(manager.jump_forward_tokens("t", pattern, [brace], [eos], 1)) <= 1


def test_every_allowed_token_keeps_the_text_a_prefix_of_some_match(tokenizer, manager):
    """Brute force on a small language: all matches of the pattern are listed."""
    pattern = "(?:cat|car|cart)s?"
    language = [w + s for w in ("cat", "car", "cart") for s in ("", "s")]
    assert all(re.fullmatch(pattern, w) for w in language)
    eos = tokenizer.eos_token_id
    vocab = token_bytes(tokenizer, tokenizer.vocab_size)
    for prefix in ["", "c", "ca", "car", "cart"]:
        ids = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
        mask = manager.allowed_mask(f"p{prefix}", pattern, ids, [eos])
        expected = {
            t
            for t, data in enumerate(vocab)
            if data and any(w.encode().startswith(prefix.encode() + data) for w in language)
        }
        if prefix in language:
            expected.add(eos)
        assert set(mask.nonzero().flatten().tolist()) == expected, prefix


def test_the_grammar_cache_keeps_the_most_recently_used(manager, monkeypatch):
    import minillm.structured.grammar as grammar

    monkeypatch.setattr(grammar, "MAX_CACHED_GRAMMARS", 3)
    first = manager.grammar("a")
    for pattern in ("b", "c"):
        manager.grammar(pattern)
    assert manager.grammar("a") is first  # used again: now the most recent
    manager.grammar("d")  # drops "b", the least recently used
    assert list(manager.grammars) == ["c", "a", "d"]
    assert manager.grammar("a") is first


def test_an_id_used_again_with_another_grammar_gets_that_grammars_matcher(tokenizer, manager):
    # a matcher left under "r" by an earlier request (of no tokens yet) must not serve a new
    # request "r" of another pattern: its mask would be the old pattern's
    eos = tokenizer.eos_token_id
    manager.allowed_mask("r", "[0-9]{4}", [], [eos])
    mask = manager.allowed_mask("r", "(?:yes|no)", [], [eos])
    vocab = token_bytes(tokenizer, tokenizer.vocab_size)
    expected = {
        t
        for t, data in enumerate(vocab)
        if data and (b"yes".startswith(data) or b"no".startswith(data))
    }
    assert set(mask.nonzero().flatten().tolist()) == expected
