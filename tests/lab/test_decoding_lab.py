"""minillm.lab.decoding against hand-derived values, brute force and simulation."""

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab import decoding
from minillm.lab.catalog import get_model_config
from minillm.lab.hardware import get_device
from minillm.model.loader import DEFAULT_MODEL
from minillm.structured.regex import compile_regex

P = [0.40, 0.25, 0.15, 0.12, 0.08]


def close(a, b):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    )


def test_filters_on_the_worked_example():
    close(decoding.processed_distribution(P, top_k=2), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0])
    # top-p 0.7: 0.40 + 0.25 = 0.65 < 0.7, so the third token stays too
    close(decoding.processed_distribution(P, top_p=0.7), [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0])
    # min-p 0.25: the cutoff is 0.25 * 0.40 = 0.10; only 0.08 falls below it
    close(decoding.processed_distribution(P, min_p=0.25), [p / 0.92 for p in P[:4]] + [0])
    powered = [p**2 for p in P]
    close(decoding.processed_distribution(P, temperature=0.5), [x / sum(powered) for x in powered])


def test_filters_refuse_bad_rows():
    with pytest.raises(ValueError, match="probs"):
        decoding.processed_distribution([0.5, 0.2])
    with pytest.raises(ValueError, match="temperature"):
        decoding.processed_distribution(P, temperature=0)


@given(st.floats(0, 1), st.integers(0, 12))
def test_expected_accepted_length_is_the_geometric_sum(alpha, k):
    assert math.isclose(
        decoding.expected_accepted_length(alpha, k),
        sum(alpha**i for i in range(k + 1)),
        rel_tol=1e-9,
        abs_tol=1e-12,
    )


def test_expected_accepted_length_of_the_glossary_example():
    assert round(decoding.expected_accepted_length(0.7, 5), 2) == 2.94


@given(st.floats(0.05, 0.95), st.floats(0.0, 0.5))
def test_best_k_is_the_brute_force_argmax(alpha, cost):
    def brute(k):
        return sum(alpha**i for i in range(k + 1)) / (1 + k * cost)

    best = decoding.best_num_speculative_tokens(alpha, cost, max_k=16)
    assert all(brute(best) >= brute(k) - 1e-12 for k in range(1, 17))
    assert math.isclose(decoding.speedup(alpha, best, cost), brute(best))


def test_acceptance_rate_estimate_recovers_a_simulated_alpha():
    rng = random.Random(0)
    alpha, k, rounds = 0.6, 4, 20000
    per_pos = [0] * k
    for _ in range(rounds):
        for j in range(k):
            if rng.random() >= alpha:
                break
            per_pos[j] += 1
    assert abs(decoding.acceptance_rate_estimate(rounds, per_pos) - alpha) < 0.01


def test_chi_square_p_value_matches_the_table():
    # df = 1: the 5% critical value is 3.841; df = 3: 7.815
    counts_df1 = [50 + 9.8, 50 - 9.8]  # statistic 2 * 9.8**2 / 50 = 3.8416
    stat, p = decoding.chi_square_p_value(counts_df1, [0.5, 0.5])
    assert math.isclose(stat, 3.8416) and abs(p - 0.05) < 1e-3
    assert decoding.chi_square_p_value([1, 0], [0.0, 1.0]) == (math.inf, 0.0)


def test_rejection_sampler_keeps_the_target_and_a_broken_rule_does_not():
    g = torch.Generator().manual_seed(3)
    p = torch.rand(8, generator=g) ** 2
    q = torch.rand(8, generator=g) ** 2
    p, q = p / p.sum(), q / q.sum()
    counts, mean_len = decoding.first_token_counts(p, q, 3, 20000, seed=1)
    assert sum(counts) == 20000
    assert decoding.chi_square_p_value(counts, p.tolist())[1] > 1e-3
    assert decoding.chi_square_p_value(counts, q.tolist())[1] < 1e-6
    broken = decoding.resample_from_target(p, q)
    assert decoding.chi_square_p_value(counts, broken.tolist())[1] < 1e-6
    assert 1 <= mean_len <= 4
    torch.testing.assert_close(decoding.resample_from_target(p, p), p)


def test_verification_slowdown_is_one_when_bandwidth_bound_and_grows_with_batch():
    config, h100 = get_model_config("Llama 3.1 8B"), get_device("H100 SXM")
    small = decoding.verification_slowdown(config, h100, 1, 4, 1024)
    large = decoding.verification_slowdown(config, h100, 512, 4, 1024)
    assert math.isclose(small, 1.0, rel_tol=1e-3)
    assert 1.2 < large <= 5.0


def test_long_contexts_keep_speculation_profitable_at_large_batch():
    """Chapter 7's batch figure: with 1,024-token contexts the KV reads keep verification
    memory-bound and the speed-up above 1 up to batch 512; with 128-token contexts it is not."""
    config, h100 = get_model_config("Llama 3.1 8B"), get_device("H100 SXM")
    tokens = decoding.expected_accepted_length(0.7, 4)

    def speedup(batch, context_len):
        return tokens / (decoding.verification_slowdown(config, h100, batch, 4, context_len) + 0.2)

    batches = [2**i for i in range(10)]
    assert min(speedup(b, 1024) for b in batches) > 1
    assert speedup(512, 1024) < speedup(1, 1024)
    assert speedup(1, 128) > 1 > speedup(512, 128)


def test_utf8_pieces_hold_back_partial_characters():
    emoji = "🙂".encode()
    pieces = decoding.utf8_pieces([b"caf", b"\xc3", b"\xa9!", emoji[:2], emoji[2:]])
    assert [text for _, text in pieces] == ["caf", "", "é!", "", "🙂"]


def test_time_token_masks_reports_ordered_statistics():
    from minillm.model.loader import resolve_model_path
    from minillm.model.tokenizer import Tokenizer
    from minillm.structured.grammar import TokenGrammar, TokenTrie, token_bytes

    tokenizer = Tokenizer(resolve_model_path(DEFAULT_MODEL))
    vocab = token_bytes(tokenizer, tokenizer.vocab_size)
    trie = TokenTrie(vocab)
    dfa = compile_regex("[0-9]{3}-[0-9]{4}")
    timing = decoding.time_token_masks(lambda: TokenGrammar(dfa, vocab, trie), [0, 1, 2], 3)
    assert timing.num_states == 3
    assert 0 < timing.cold_min_s <= timing.cold_median_s <= timing.cold_max_s
    assert 0 < timing.cached_min_s <= timing.cached_median_s <= timing.cached_max_s
