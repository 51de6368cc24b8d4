"""LLM.beam_search against an exhaustive search over every continuation of a tiny model.

The model is a random Llama with a vocabulary of 8 (EOS = 1), built by transformers, which
also scores every prefix for the oracle with a plain forward over the whole sequence: no KV
cache, no engine.
"""

import itertools
import json
import math

import pytest
import tokenizers
import torch

from minillm import LLM
from minillm.engine.beam_search import get_beam_search_score
from minillm.sampling_params import BeamSearchParams

VOCAB, EOS = 8, 1
PROMPT = [0, 3, 5, 2, 6]


def write_tokenizer(out):
    """A word-level tokenizer of exactly VOCAB tokens: <s>, </s> and the letters a..f."""
    vocab = {"<s>": 0, "</s>": EOS, **{chr(ord("a") + i): 2 + i for i in range(VOCAB - 2)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers

    out = tmp_path_factory.mktemp("tiny-vocab8")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
        bos_token_id=0,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(config).float().eval().save_pretrained(out)
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def oracle(model_dir):
    """logprobs(prefix) -> [VOCAB] of the next token, by a full forward (memoized)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).float().eval()
    cache = {}

    def logprobs(tokens: tuple[int, ...]) -> list[float]:
        if tokens not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([list(tokens)])).logits[0, -1]
            cache[tokens] = logits.double().log_softmax(-1).tolist()
        return cache[tokens]

    return logprobs


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", block_size=4, max_model_len=64, enforce_eager=True)


def score(tokens, cum, length_penalty):
    """The score, written out: cum / (length without a final EOS) ** length_penalty."""
    length = len(tokens) - (tokens[-1] == EOS)
    return cum / length**length_penalty


def exhaustive_hypotheses(oracle, prompt, depth):
    """Every finished hypothesis: a continuation that ends in its first EOS, or one of `depth`
    tokens; with its cumulative logprob."""
    out = []
    for length in range(1, depth + 1):
        for continuation in itertools.product(range(VOCAB), repeat=length):
            if EOS in continuation[:-1] or (length < depth and continuation[-1] != EOS):
                continue
            tokens = tuple(prompt) + continuation
            cum = sum(oracle(tokens[: len(prompt) + i])[t] for i, t in enumerate(continuation))
            out.append((tokens, cum))
    return out


def reference_beam_search(oracle, prompt, width, depth, length_penalty):
    """Beam search with vLLM's rules on the oracle's logprobs: each beam's 2 * width best
    next tokens are candidates; those ending in EOS finish; the best `width` others go on."""
    beams, done = [(tuple(prompt), 0.0)], []
    for _ in range(depth):
        candidates = []
        for tokens, cum in beams:
            logprobs = oracle(tokens)
            best = sorted(range(VOCAB), key=lambda t: -logprobs[t])[: 2 * width]
            candidates += [((*tokens, t), cum + logprobs[t]) for t in best]
        done += [c for c in candidates if c[0][-1] == EOS]
        rest = [c for c in candidates if c[0][-1] != EOS]
        beams = sorted(rest, key=lambda c: -score(*c, length_penalty))[:width]
    return sorted(done + beams, key=lambda c: -score(*c, length_penalty))[:width]


def assert_same(result, expected):
    assert [tuple(seq.tokens) for seq in result.sequences] == [tokens for tokens, _ in expected]
    for seq, (_, cum) in zip(result.sequences, expected, strict=True):
        assert math.isclose(seq.cum_logprob, cum, abs_tol=1e-4)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_wide_beams_find_the_exhaustive_best_at_depth_two(llm, oracle, length_penalty):
    # beam_width 7 keeps every non-EOS first token, and 2 * 7 logprobs cover the vocabulary:
    # the search then sees every hypothesis of up to two tokens
    width, depth = 7, 2
    [result] = llm.beam_search(
        [PROMPT], BeamSearchParams(width, depth, length_penalty=length_penalty)
    )
    hypotheses = exhaustive_hypotheses(oracle, PROMPT, depth)
    expected = sorted(hypotheses, key=lambda h: -score(*h, length_penalty))[:width]
    assert_same(result, expected)


@pytest.mark.parametrize(
    ("width", "depth", "length_penalty"), [(2, 3, 1.0), (3, 4, 0.5), (4, 3, 2.0)]
)
def test_beam_search_matches_the_same_search_on_exhaustive_scores(
    llm, oracle, width, depth, length_penalty
):
    params = BeamSearchParams(width, depth, length_penalty=length_penalty)
    [result] = llm.beam_search([PROMPT], params)
    assert_same(result, reference_beam_search(oracle, PROMPT, width, depth, length_penalty))
    # each beam's score is vLLM's formula of its own tokens and cumulative logprob
    for seq in result.sequences:
        expected = score(seq.tokens, seq.cum_logprob, length_penalty)
        assert get_beam_search_score(seq.tokens, seq.cum_logprob, EOS, length_penalty) == expected


def test_beams_share_their_prefix_blocks_through_the_cache(llm):
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    hits_before = stats.num_hit_tokens
    llm.beam_search([PROMPT, [0, 4, 4, 7]], BeamSearchParams(3, 4))
    # every beam after the first step finds its parent's full blocks in the cache
    assert stats.num_hit_tokens - hits_before >= 4 * 3 * 3


def test_ignore_eos_keeps_eos_beams_going(llm, oracle):
    [result] = llm.beam_search([PROMPT], BeamSearchParams(3, 3, ignore_eos=True))
    assert all(len(seq.tokens) == len(PROMPT) + 3 for seq in result.sequences)
    assert all(seq.finish_reason == "length" for seq in result.sequences)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(beam_width=0, max_tokens=3), "beam_width must be an int in [1, 10]"),
        (dict(beam_width=11, max_tokens=3), "beam_width must be an int in [1, 10]"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be an int >= 1"),
        (dict(beam_width=2, max_tokens=2, length_penalty=math.nan), "length_penalty"),
    ],
)
def test_bad_beam_search_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        BeamSearchParams(**kwargs)


def test_beams_that_fill_max_model_len_finish_by_length(llm):
    # a 60-token prompt and max_tokens=10 on max_model_len=64: the beams stop at 64 tokens,
    # as generate's requests do, instead of the search failing on their 64-token "prompts"
    prompt = [0] + [4, 7, 5] * 19 + [4, 7]
    assert len(prompt) == 60
    [result] = llm.beam_search([prompt], BeamSearchParams(2, 10, ignore_eos=True))
    assert result.sequences and all(len(seq.tokens) == 64 for seq in result.sequences)
    assert all(seq.finish_reason == "length" for seq in result.sequences)
