"""The speed-up model the benchmark and chapter 7 use (minillm.lab.decoding), against an
enumeration of every acceptance pattern."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab.decoding import alpha_from_tokens_per_round, expected_accepted_length, speedup


def enumerated_tokens_per_round(alpha: float, k: int) -> float:
    """Sum over all 2^k accept/reject patterns: the round yields the drafts before the first
    rejection plus one token."""
    total = 0.0
    for pattern in itertools.product([True, False], repeat=k):
        prob = 1.0
        for accepted in pattern:
            prob *= alpha if accepted else 1 - alpha
        first_reject = next((i for i, a in enumerate(pattern) if not a), k)
        total += prob * (first_reject + 1)
    return total


@given(alpha=st.floats(0, 1), k=st.integers(0, 7))
def test_tokens_per_round_matches_the_enumeration(alpha, k):
    assert expected_accepted_length(alpha, k) == pytest.approx(
        enumerated_tokens_per_round(alpha, k), rel=1e-9, abs=1e-12
    )


def test_known_values_and_the_speedup():
    assert expected_accepted_length(0.0, 4) == 1.0
    assert expected_accepted_length(1.0, 4) == 5.0
    assert expected_accepted_length(0.5, 2) == pytest.approx(1.75)
    # free drafts: the speed-up is the tokens per round; a draft as dear as the target: less
    assert speedup(0.8, 4, 0.0) == pytest.approx(expected_accepted_length(0.8, 4))
    assert speedup(0.8, 4, 1.0) == pytest.approx((1 - 0.8**5) / 0.2 / 5)
    with pytest.raises(ValueError, match="alpha"):
        expected_accepted_length(1.5, 2)
    with pytest.raises(ValueError, match="draft_cost"):
        speedup(0.5, 2, -1)


@given(alpha=st.floats(0, 1), k=st.integers(1, 6))
def test_the_fitted_alpha_inverts_the_model(alpha, k):
    tokens = enumerated_tokens_per_round(alpha, k)
    assert alpha_from_tokens_per_round(tokens, k) == pytest.approx(alpha, abs=1e-6)
