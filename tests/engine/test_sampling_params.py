"""SamplingParams: defaults, normalization of stop conditions, and every validation error."""

import math

import pytest

from minillm.sampling_params import SamplingParams


def test_defaults_are_valid_and_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert params.max_tokens == 16
    assert params.stop == []
    assert params.stop_token_ids == []
    assert not params.is_greedy


def test_stop_string_is_normalized_to_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]


def test_stop_lists_are_copied():
    stop, stop_token_ids = ["x"], [7]
    params = SamplingParams(stop=stop, stop_token_ids=stop_token_ids)
    stop.append("y")
    stop_token_ids.append(8)
    assert params.stop == ["x"]
    assert params.stop_token_ids == [7]


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(repetition_penalty=0.5),
        dict(max_tokens=None, min_tokens=1000),
        dict(max_tokens=5, min_tokens=5),
        dict(logprobs=0),
        dict(seed=-3),
        dict(stop=[]),
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, expected_message",
    [
        (dict(n=0), "n must be an int >= 1, got 0"),
        (dict(temperature=-0.1), "temperature must be >= 0 (0 is greedy), got -0.1"),
        (dict(temperature=math.nan), "temperature must be >= 0 (0 is greedy), got nan"),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(top_k=-2), "top_k must be an int >= 1, or 0 or -1 to turn it off, got -2"),
        (dict(top_k=2.5), "top_k must be an int >= 1, or 0 or -1 to turn it off, got 2.5"),
        (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
        (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
        (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2], got -2.01"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 (1 is off), got 0.0"),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0 (1 is off), got -1.0"),
        (dict(seed=1.5), "seed must be None or an int, got 1.5"),
        (dict(max_tokens=0), "max_tokens must be None or an int >= 1, got 0"),
        (dict(min_tokens=-1), "min_tokens must be an int >= 0, got -1"),
        (
            dict(max_tokens=4, min_tokens=5),
            "min_tokens must be <= max_tokens, got min_tokens=5 and max_tokens=4",
        ),
        (dict(logprobs=-1), "logprobs must be None or an int >= 0, got -1"),
        (dict(stop=42), "stop must be None, a str or a list of str, got 42"),
        (dict(stop=("a",)), "stop must be None, a str or a list of str, got ('a',)"),
        (dict(stop=["a", 1]), "stop must be None, a str or a list of str, got ['a', 1]"),
        (dict(stop=["a", ""]), "stop strings must be non-empty, got ['a', '']"),
        (
            dict(stop_token_ids=[1, "2"]),
            "stop_token_ids must be None or a list of ints >= 0, got [1, '2']",
        ),
        (
            dict(stop_token_ids=[1.0]),
            "stop_token_ids must be None or a list of ints >= 0, got [1.0]",
        ),
        (
            dict(stop_token_ids=[True]),
            "stop_token_ids must be None or a list of ints >= 0, got [True]",
        ),
        (
            dict(stop_token_ids=[-1]),
            "stop_token_ids must be None or a list of ints >= 0, got [-1]",
        ),
        (dict(stop_token_ids=3), "stop_token_ids must be None or a list of ints >= 0, got 3"),
    ],
)
def test_invalid_values_raise_with_what_was_given_and_what_is_allowed(kwargs, expected_message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == expected_message
