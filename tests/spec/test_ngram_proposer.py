"""n-gram (prompt lookup) proposals: vLLM's examples and rule, against an exhaustive search."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from minillm.spec.ngram_proposer import ngram_propose


def exhaustive(tokens, min_n, max_n, k, max_model_len):
    """Every (n, start) of an earlier occurrence of the last n tokens; the longest n wins,
    then the earliest start."""
    k = min(k, max_model_len - len(tokens))
    if k <= 0:
        return []
    matches = [
        (-n, start)
        for n in range(min_n, max_n + 1)
        if n < len(tokens)
        for start in range(len(tokens) - n)
        if tokens[start : start + n] == tokens[len(tokens) - n :]
    ]
    if not matches:
        return []
    neg_n, start = min(matches)
    return tokens[start - neg_n : start - neg_n + k]


def test_vllm_docstring_example():
    # the last 3 tokens [4, 2, 3] occur nowhere else; [2, 3] does, followed by [4, 2, 3]
    assert ngram_propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_longest_match_then_earliest_occurrence():
    tokens = [5, 1, 2, 9, 7, 1, 2, 8, 3, 1, 2]
    # [1, 2] occurs at 1 and 5: the earliest is taken
    assert ngram_propose(tokens, 1, 2, 2) == [9, 7]
    # with the 3-gram [3, 1, 2] absent, a longer window changes nothing
    assert ngram_propose(tokens, 2, 3, 2) == [9, 7]
    assert ngram_propose([4, 4, 4], 1, 1, 5) == [4, 4]  # overlapping the suffix is allowed
    assert ngram_propose([1, 2, 3], 1, 2, 3) == []  # no earlier occurrence
    assert ngram_propose([1, 2, 1, 2], 2, 2, 3, max_model_len=5) == [1]  # room for one token


@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
    room=st.integers(0, 8),
)
def test_matches_the_exhaustive_search(tokens, min_n, extra, k, room):
    max_n = min_n + extra
    max_model_len = len(tokens) + room
    got = ngram_propose(tokens, min_n, max_n, k, max_model_len)
    assert got == exhaustive(tokens, min_n, max_n, k, max_model_len)
