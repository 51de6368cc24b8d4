"""The sampler: filters against brute-force oracles, worked examples, penalties by hand,
sampled frequencies, seeds that ignore the rest of the batch, and raw logprobs.

Oracles work on exact fractions over plain Python lists and share no code with the sampler.
Their tie rule is the sampler's: tokens tied at a cutoff are kept or dropped together.
"""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from minillm.sampling_params import SamplingParams
from minillm.worker.sampler import (
    Sampler,
    SamplingState,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_generator,
)

# The worked example: five tokens A..E.
P = [0.40, 0.25, 0.15, 0.12, 0.08]
LOGITS = torch.tensor([[math.log(p) for p in P]])

# Draws whose float32 arithmetic lands this close to a cutoff may go either way; skip them.
MARGIN = 1e-5


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [{t for t, x in enumerate(row) if x != -math.inf} for row in logits.tolist()]


def state(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingState:
    return SamplingState(params, list(prompt), list(output), generator)


# ---- brute-force oracles over integer weights w (probabilities w / sum(w)) ----


def oracle_top_k(w: list[int], k: int) -> set[int]:
    """The k largest weights, plus everything tied with the k-th largest."""
    if k <= 0 or k >= len(w):
        return set(range(len(w)))
    kth = sorted(w, reverse=True)[k - 1]
    return {t for t in range(len(w)) if w[t] >= kth}


def oracle_top_p(w: list[int], top_p: float) -> set[int]:
    """Token t stays while the probability of the strictly more likely tokens is below top_p."""
    total = sum(w)
    result = set()
    for t in range(len(w)):
        mass_above = Fraction(sum(x for x in w if x > w[t]), total)
        if top_p < 1:
            assume(abs(mass_above - Fraction(top_p)) > MARGIN)
        if mass_above < Fraction(top_p):
            result.add(t)
    return result


def oracle_min_p(w: list[int], min_p: float) -> set[int]:
    """Tokens with p >= min_p * max p."""
    result = set()
    for t in range(len(w)):
        ratio = Fraction(w[t], max(w))
        if 0 < min_p < 1:
            assume(abs(ratio - Fraction(min_p)) > MARGIN)
        if ratio >= Fraction(min_p):
            result.add(t)
    return result


def weight_logits(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[math.log(x) for x in w] for w in rows])


# Small integer weights, so that ties are common.
batches = st.integers(1, 12).flatmap(
    lambda vocab: st.lists(
        st.lists(st.integers(1, 20), min_size=vocab, max_size=vocab), min_size=1, max_size=4
    )
)


@given(data=st.data(), rows=batches)
def test_top_k_keeps_the_oracle_set(data, rows):
    vocab = len(rows[0])
    ks = [data.draw(st.integers(-1, vocab + 2)) for _ in rows]
    out = apply_top_k(weight_logits(rows), torch.tensor(ks))
    assert kept(out) == [oracle_top_k(w, k) for w, k in zip(rows, ks, strict=True)]


@given(data=st.data(), rows=batches)
def test_top_p_keeps_the_oracle_set(data, rows):
    top_ps = [data.draw(st.floats(0.001, 1.0)) for _ in rows]
    out = apply_top_p(weight_logits(rows), torch.tensor(top_ps))
    assert kept(out) == [oracle_top_p(w, p) for w, p in zip(rows, top_ps, strict=True)]


@given(data=st.data(), rows=batches)
def test_min_p_keeps_the_oracle_set(data, rows):
    min_ps = [data.draw(st.floats(0.0, 1.0)) for _ in rows]
    out = apply_min_p(weight_logits(rows), torch.tensor(min_ps))
    assert kept(out) == [oracle_min_p(w, p) for w, p in zip(rows, min_ps, strict=True)]


def on_survivors(oracle, w: list[int], survivors: set[int], arg) -> set[int]:
    """Apply an oracle to the surviving tokens only: the filters renormalize what they keep."""
    ids = sorted(survivors)
    return {ids[i] for i in oracle([w[t] for t in ids], arg)}


@given(
    w=st.lists(st.integers(1, 20), min_size=1, max_size=12),
    k=st.integers(0, 12),
    top_p=st.floats(0.001, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_chain_on_the_renormalized_survivors(w, k, top_p, min_p):
    after_top_p = on_survivors(oracle_top_p, w, oracle_top_k(w, k), top_p)
    expected = on_survivors(oracle_min_p, w, after_top_p, min_p)

    logits = apply_top_k(weight_logits([w]), torch.tensor([k]))
    logits = apply_top_p(logits, torch.tensor([top_p]))
    logits = apply_min_p(logits, torch.tensor([min_p]))
    assert kept(logits) == [expected]


# ---- the worked example ----


def test_worked_example_temperature():
    probs = apply_temperature(LOGITS, torch.tensor([0.5])).softmax(-1)[0]
    squared = [p * p for p in P]
    expected = [s / sum(squared) for s in squared]
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)
    assert probs.tolist() == pytest.approx([0.602, 0.235, 0.0847, 0.0542, 0.0241], abs=5e-4)


def test_worked_example_top_k():
    probs = apply_top_k(LOGITS, torch.tensor([3])).softmax(-1)[0]
    assert probs.tolist() == pytest.approx([0.5, 0.3125, 0.1875, 0.0, 0.0], abs=1e-6)


def test_worked_example_top_p():
    # cumulative 0.40, 0.65, 0.80: the third token is the first to reach 0.75
    probs = apply_top_p(LOGITS, torch.tensor([0.75])).softmax(-1)[0]
    assert probs.tolist() == pytest.approx([0.5, 0.3125, 0.1875, 0.0, 0.0], abs=1e-6)


def test_worked_example_min_p():
    # threshold 0.25 * 0.40 = 0.10: D = 0.12 stays, E = 0.08 goes
    probs = apply_min_p(LOGITS, torch.tensor([0.25])).softmax(-1)[0]
    expected = [p / 0.92 for p in P[:4]] + [0.0]
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)


def test_temperature_comes_before_top_p():
    # at T = 0.5 the top two already hold 0.602 + 0.235 >= 0.75, so only two stay (three at T = 1)
    logits = apply_temperature(LOGITS, torch.tensor([0.5]))
    assert kept(apply_top_p(logits, torch.tensor([0.75]))) == [{0, 1}]


def test_top_p_stops_at_the_token_that_reaches_it_exactly():
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.25, 0.15, 0.10)]])
    # dyadic probabilities survive float32 exactly, so the cumulative sum hits 0.5 and 0.75
    assert logits.softmax(-1)[0, :2].tolist() == [0.5, 0.25]
    assert kept(apply_top_p(logits, torch.tensor([0.5]))) == [{0}]
    assert kept(apply_top_p(logits, torch.tensor([0.75]))) == [{0, 1}]


def test_ties_at_the_cutoff_stay_together():
    assert kept(apply_top_k(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), torch.tensor([1]))) == [{1, 2}]
    ties = torch.tensor([[math.log(p) for p in (0.3, 0.3, 0.2, 0.2)]])
    assert kept(apply_top_p(ties, torch.tensor([0.5]))) == [{0, 1}]
    # three tokens reach 0.65, but the fourth is tied with the third
    assert kept(apply_top_p(ties, torch.tensor([0.65]))) == [{0, 1, 2, 3}]


def test_filters_that_are_off_keep_everything():
    everything = [set(range(5))]
    assert kept(apply_top_k(LOGITS, torch.tensor([0]))) == everything
    assert kept(apply_top_k(LOGITS, torch.tensor([-1]))) == everything
    assert kept(apply_top_k(LOGITS, torch.tensor([5]))) == everything
    assert kept(apply_top_p(LOGITS, torch.tensor([1.0]))) == everything
    assert kept(apply_min_p(LOGITS, torch.tensor([0.0]))) == everything
    # top_p = 1 keeps even tokens far below the float32 resolution of the cumulative sum
    tiny = torch.tensor([[0.0, -30.0, -60.0]])
    assert kept(apply_top_p(tiny, torch.tensor([1.0]))) == [{0, 1, 2}]


# ---- penalties ----

PENALTY_LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
PROMPT = [[0, 1]]  # token 0 (positive) and 1 (negative) occur only in the prompt
OUTPUT = [[3, 3, 2]]  # token 3 twice, token 2 once; tokens 4 and 5 never occur


def penalize(presence=0.0, frequency=0.0, repetition=1.0) -> list[float]:
    out = apply_penalties(
        PENALTY_LOGITS,
        PROMPT,
        OUTPUT,
        torch.tensor([presence]),
        torch.tensor([frequency]),
        torch.tensor([repetition]),
    )
    return out[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # prompt and output tokens 0..3 are penalized; 4 and 5 are untouched
    assert penalize(repetition=2.0) == pytest.approx([1.0, -2.0, 0.25, 1.5, -2.0, 1.0])


def test_frequency_penalty_counts_output_tokens_only():
    assert penalize(frequency=0.5) == pytest.approx([2.0, -1.0, 0.0, 2.0, -2.0, 1.0])


def test_presence_penalty_applies_once_per_output_token():
    assert penalize(presence=0.25) == pytest.approx([2.0, -1.0, 0.25, 2.75, -2.0, 1.0])


def test_all_penalties_together():
    # token 2: 0.5 / 2 - 0.5 * 1 - 0.25 = -0.5; token 3: 3 / 2 - 0.5 * 2 - 0.25 = 0.25
    expected = [1.0, -2.0, -0.5, 0.25, -2.0, 1.0]
    assert penalize(presence=0.25, frequency=0.5, repetition=2.0) == pytest.approx(expected)


def test_negative_penalties_reward_repeats():
    assert penalize(presence=-1.0, frequency=-0.5) == pytest.approx(
        [2.0, -1.0, 2.0, 5.0, -2.0, 1.0]
    )


def test_penalties_are_per_row():
    logits = PENALTY_LOGITS.repeat(2, 1)
    out = apply_penalties(
        logits,
        PROMPT * 2,
        [[3], []],
        torch.tensor([0.0, 1.0]),
        torch.tensor([1.0, 0.0]),
        torch.tensor([1.0, 2.0]),
    )
    assert out[0].tolist() == pytest.approx([2.0, -1.0, 0.5, 2.0, -2.0, 1.0])
    assert out[1].tolist() == pytest.approx([1.0, -2.0, 0.5, 3.0, -2.0, 1.0])


def test_sampler_applies_penalties_before_greedy_argmax():
    # raw argmax is token 3 (3.0); after the penalties token 0 (1.0) and 5 (1.0) tie; lowest wins
    params = SamplingParams(
        temperature=0.0, presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0
    )
    request = state(params, PROMPT[0], OUTPUT[0])
    assert Sampler()(PENALTY_LOGITS, [request]).token_ids == [0]


def test_min_tokens_masks_stop_and_eos_tokens_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # token 1 is eos, token 2 a stop token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    early = SamplingState(params, [0], [3], None, eos_token_ids=[1])
    done = SamplingState(params, [0], [3, 3], None, eos_token_ids=[1])
    assert Sampler()(logits.repeat(2, 1), [early, done]).token_ids == [3, 1]
    ignore_eos = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler()(logits, [SamplingState(ignore_eos, [0], [3], None, [1])]).token_ids == [1]


# ---- greedy and logprobs ----


def test_greedy_is_argmax_and_draws_no_random_numbers():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[5, 7] = logits[5, 9] = logits[5].max() + 1.0  # a tie: the lower id wins
    generator = torch.Generator().manual_seed(1)
    before = generator.get_state()
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)
    out = Sampler(generator)(logits, [state(params) for _ in range(6)])
    expected = [max(range(50), key=lambda t, row=row: (row[t], -t)) for row in logits.tolist()]
    assert out.token_ids == expected
    assert expected[5] == 7
    assert torch.equal(generator.get_state(), before)


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(2))
    rows = [state(SamplingParams(temperature=0.0 if i % 2 else 1.5)) for i in range(8)]
    out = Sampler(torch.Generator().manual_seed(3))(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]


def oracle_log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    log_total = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_total for x in row]


def test_logprobs_are_from_the_raw_logits():
    logits = 3 * torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    rows = [
        state(SamplingParams(temperature=0.3, top_k=5, repetition_penalty=1.5, logprobs=4), [1]),
        state(SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=0), [], [2, 2]),
        state(SamplingParams(min_p=0.5)),
    ]
    out = Sampler(torch.Generator().manual_seed(5))(logits, rows)
    raw = [oracle_log_softmax(row) for row in logits.tolist()]
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(raw[row][token], abs=1e-5)

    assert out.top_logprobs[1] == []
    assert out.top_logprobs[2] is None
    top = out.top_logprobs[0]
    assert len(top) == 4
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    for token, lp in top:
        assert lp == pytest.approx(raw[0][token], abs=1e-5)
    assert [lp for _, lp in top] == pytest.approx(sorted(raw[0], reverse=True)[:4], abs=1e-5)


def test_more_top_logprobs_than_the_vocabulary_returns_all():
    out = Sampler()(LOGITS, [state(SamplingParams(temperature=0.0, logprobs=20))])
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1, 2, 3, 4]
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx([math.log(p) for p in P])


def test_logits_must_have_one_row_per_request():
    with pytest.raises(ValueError, match=r"expected logits of shape \[2, vocab_size\]"):
        Sampler()(LOGITS, [state(SamplingParams())] * 2)


# ---- sampled frequencies ----

# Temperature 0.5 squares p: A..E in proportion 0.16, 0.0625, 0.0225, 0.0144, 0.0064.
# top-k = 4 drops E; top-p = 0.9 drops D (mass before it 0.2450 / 0.2594 = 0.944 >= 0.9);
# min-p = 0.2 drops C (0.0225 < 0.2 * 0.16); A and B remain.
FILTERED_PARAMS = dict(temperature=0.5, top_k=4, top_p=0.9, min_p=0.2)
FILTERED = [0.16 / 0.2225, 0.0625 / 0.2225, 0.0, 0.0, 0.0]


def frequencies(token_ids: list[int]) -> list[float]:
    return [token_ids.count(t) / len(token_ids) for t in range(len(P))]


def test_unseeded_samples_follow_the_filtered_distribution():
    num_draws = 20_000
    rows = [state(SamplingParams(**FILTERED_PARAMS))] * num_draws
    out = Sampler(torch.Generator().manual_seed(6))(LOGITS.repeat(num_draws, 1), rows)
    freq = frequencies(out.token_ids)
    assert freq[2] == freq[3] == freq[4] == 0.0
    # the largest standard deviation is sqrt(0.25 / 20_000) = 0.0035; 0.015 is over 4 of them
    assert max(abs(f - p) for f, p in zip(freq, FILTERED, strict=True)) < 0.015


def test_seeded_samples_follow_the_filtered_distribution():
    num_draws = 4_000
    params = SamplingParams(seed=100, n=num_draws, **FILTERED_PARAMS)
    rows = [state(params, generator=make_generator(100, i, "cpu")) for i in range(num_draws)]
    out = Sampler()(LOGITS.repeat(num_draws, 1), rows)
    freq = frequencies(out.token_ids)
    assert freq[2] == freq[3] == freq[4] == 0.0
    # standard deviation at most sqrt(0.25 / 4_000) = 0.0079
    assert max(abs(f - p) for f, p in zip(freq, FILTERED, strict=True)) < 0.035


def test_plain_sampling_follows_softmax():
    num_draws = 20_000
    rows = [state(SamplingParams())] * num_draws
    out = Sampler(torch.Generator().manual_seed(7))(LOGITS.repeat(num_draws, 1), rows)
    assert max(abs(f - p) for f, p in zip(frequencies(out.token_ids), P, strict=True)) < 0.015


# ---- seeds ----

VOCAB, STEPS = 16, 12
STEP_LOGITS = 2 * torch.randn(STEPS, VOCAB, generator=torch.Generator().manual_seed(8))
SEEDED = SamplingParams(seed=11, top_p=0.9, repetition_penalty=1.3)
REQUESTS = {
    "a": (SEEDED, 0.0),
    "b": (SamplingParams(seed=12, n=2, temperature=1.5), 1.0),
    "c": (SamplingParams(temperature=0.8), 2.0),  # unseeded
    "d": (SamplingParams(temperature=0.0), 3.0),  # greedy
}


def generate(names: list[str], shared_seed: int, child: int = 0) -> dict[str, list[int]]:
    """Decode STEPS tokens for the named requests batched together, in the given row order."""
    states = []
    for name in names:
        params, _ = REQUESTS[name]
        states.append(state(params, [1, 2], [], make_generator(params.seed, child, "cpu")))
    sampler = Sampler(torch.Generator().manual_seed(shared_seed))
    for step in range(STEPS):
        # every request has its own logits, the same whatever the batch
        logits = torch.stack([STEP_LOGITS[step].roll(int(REQUESTS[n][1])) for n in names])
        for request, token in zip(states, sampler(logits, states).token_ids, strict=True):
            request.output_token_ids.append(token)
    return {name: s.output_token_ids for name, s in zip(names, states, strict=True)}


def test_a_seeded_request_gives_the_same_tokens_whatever_the_batch():
    alone = generate(["a"], shared_seed=0)["a"]
    assert len(set(alone)) > 2  # really random, so the comparisons below can fail
    assert generate(["c", "a", "b", "d"], shared_seed=1)["a"] == alone
    assert generate(["b", "d", "a", "c"], shared_seed=2)["a"] == alone
    assert generate(["a", "a"], shared_seed=3)["a"] == alone

    b_alone = generate(["b"], shared_seed=4)["b"]
    assert generate(["d", "c", "a", "b"], shared_seed=5)["b"] == b_alone


def test_children_and_seeds_draw_different_streams():
    first_child = generate(["b"], shared_seed=0)["b"]
    second_child = generate(["b"], shared_seed=0, child=1)["b"]
    assert first_child != second_child
    assert make_generator(None, 0, "cpu") is None
    assert make_generator(12, 1, "cpu").initial_seed() == 13
