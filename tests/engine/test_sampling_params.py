"""SamplingParams: defaults, normalization, immutability, every validation error, and the
sampler accepting every value that validation accepts."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.sampling_params import (
    FLOAT32_MAX,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    SamplingParams,
)
from minillm.worker.sampler import Sampler, SamplingState, make_generator


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
    assert params.stop == ()
    assert params.stop_token_ids == ()
    assert (params.ignore_eos, params.include_stop_str_in_output) == (False, False)
    assert params.skip_special_tokens is True
    assert not params.is_greedy


def test_stop_conditions_are_normalized_to_tuples():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("a",)).stop == ("a",)
    assert SamplingParams(stop_token_ids=(3, np.int64(4))).stop_token_ids == (3, 4)
    assert type(SamplingParams(stop_token_ids=[np.int32(4)]).stop_token_ids[0]) is int


def test_stop_lists_are_copied():
    stop, stop_token_ids = ["x"], [7]
    params = SamplingParams(stop=stop, stop_token_ids=stop_token_ids)
    stop.append("y")
    stop_token_ids.append(8)
    assert params.stop == ("x",)
    assert params.stop_token_ids == (7,)


def test_numpy_numbers_become_python_numbers():
    params = SamplingParams(
        n=np.int64(2),
        temperature=np.float32(0.5),
        top_k=np.int32(7),
        seed=np.uint64(2**64 - 2),
        max_tokens=np.int16(9),
        logprobs=np.int8(3),
    )
    values = (params.n, params.temperature, params.top_k, params.seed, params.max_tokens)
    assert values == (2, 0.5, 7, 2**64 - 2, 9)
    assert [type(v) for v in (*values, params.logprobs)] == [int, float, int, int, int, int]
    # an int is a valid float
    assert SamplingParams(temperature=0).temperature == 0.0
    assert type(SamplingParams(temperature=2).temperature) is float


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SamplingParams)])
def test_frozen_every_field(field):
    params = SamplingParams(stop=["x"], stop_token_ids=[3])
    before = getattr(params, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(params, field, before)
    assert getattr(params, field) == before


def test_equal_params_hash_equal():
    a = SamplingParams(stop=["x"], stop_token_ids=[3], seed=1)
    b = SamplingParams(stop=("x",), stop_token_ids=(3,), seed=1)
    assert a == b and hash(a) == hash(b)
    assert a != dataclasses.replace(a, seed=2)


def test_replace_validates_again():
    with pytest.raises(ValueError, match="temperature must be"):
        dataclasses.replace(SamplingParams(), temperature=-1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_k=MAX_TOP_K),
        dict(temperature=FLOAT32_MAX),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(repetition_penalty=MIN_REPETITION_PENALTY),
        dict(repetition_penalty=MAX_REPETITION_PENALTY),
        dict(max_tokens=None, min_tokens=1000),
        dict(max_tokens=5, min_tokens=5),
        dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS),
        dict(seed=-3),
        dict(seed=MIN_SEED, n=4),
        dict(seed=MAX_SEED),
        dict(seed=MAX_SEED - 3, n=4),
        dict(stop=[]),
        dict(stop_token_ids=[0, MAX_TOKEN_ID]),
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("stop", "stop_token_ids"):
            assert getattr(params, name) == value


@pytest.mark.parametrize(
    "kwargs, expected_message",
    [
        (dict(n=0), "n must be an int >= 1, got 0"),
        (dict(n=True), "n must be an int >= 1, got True"),
        (
            dict(temperature=-0.1),
            "temperature must be a float in [0, 3.403e+38] (0 is greedy), got -0.1",
        ),
        (
            dict(temperature=math.nan),
            "temperature must be a float in [0, 3.403e+38] (0 is greedy), got nan",
        ),
        (
            dict(temperature=math.inf),
            "temperature must be a float in [0, 3.403e+38] (0 is greedy), got inf",
        ),
        (
            dict(temperature=1e39),  # finite in float64, inf in the sampler's float32
            "temperature must be a float in [0, 3.403e+38] (0 is greedy), got 1e+39",
        ),
        (
            dict(temperature="0.5"),
            "temperature must be a float in [0, 3.403e+38] (0 is greedy), got '0.5'",
        ),
        (
            dict(temperature=None),
            "temperature must be a float in [0, 3.403e+38] (0 is greedy), got None",
        ),
        (dict(top_p=0.0), "top_p must be a float in (0, 1], got 0.0"),
        (dict(top_p=1.5), "top_p must be a float in (0, 1], got 1.5"),
        (
            dict(top_k=-2),
            "top_k must be an int in [1, 2147483647], or 0 or -1 to turn it off, got -2",
        ),
        (
            dict(top_k=2**31),
            "top_k must be an int in [1, 2147483647], or 0 or -1 to turn it off, got 2147483648",
        ),
        (
            dict(top_k=2.5),
            "top_k must be an int in [1, 2147483647], or 0 or -1 to turn it off, got 2.5",
        ),
        (
            dict(top_k=False),
            "top_k must be an int in [1, 2147483647], or 0 or -1 to turn it off, got False",
        ),
        (dict(min_p=-0.1), "min_p must be a float in [0, 1], got -0.1"),
        (dict(min_p=1.1), "min_p must be a float in [0, 1], got 1.1"),
        (dict(presence_penalty=2.5), "presence_penalty must be a float in [-2, 2], got 2.5"),
        (
            dict(frequency_penalty=-2.01),
            "frequency_penalty must be a float in [-2, 2], got -2.01",
        ),
        (
            dict(repetition_penalty=0.0),
            "repetition_penalty must be a float in [0.01, 100] (1 is off), got 0.0",
        ),
        (
            dict(repetition_penalty=-1.0),
            "repetition_penalty must be a float in [0.01, 100] (1 is off), got -1.0",
        ),
        (
            dict(repetition_penalty=math.inf),
            "repetition_penalty must be a float in [0.01, 100] (1 is off), got inf",
        ),
        (
            dict(repetition_penalty="2"),
            "repetition_penalty must be a float in [0.01, 100] (1 is off), got '2'",
        ),
        (
            dict(seed=1.5),
            "seed must be None or an int in [-2**63, 2**64 - n] (completion i seeds a 64-bit "
            "torch generator with seed + i; here n=1), got 1.5",
        ),
        (
            dict(seed=True),
            "seed must be None or an int in [-2**63, 2**64 - n] (completion i seeds a 64-bit "
            "torch generator with seed + i; here n=1), got True",
        ),
        (
            dict(seed=2**64),
            "seed must be None or an int in [-2**63, 2**64 - n] (completion i seeds a 64-bit "
            "torch generator with seed + i; here n=1), got 18446744073709551616",
        ),
        (
            dict(seed=2**64 - 1, n=2),
            "seed must be None or an int in [-2**63, 2**64 - n] (completion i seeds a 64-bit "
            "torch generator with seed + i; here n=2), got 18446744073709551615",
        ),
        (
            dict(seed=-(2**63) - 1),
            "seed must be None or an int in [-2**63, 2**64 - n] (completion i seeds a 64-bit "
            "torch generator with seed + i; here n=1), got -9223372036854775809",
        ),
        (dict(max_tokens=0), "max_tokens must be None or an int >= 1, got 0"),
        (dict(max_tokens=True), "max_tokens must be None or an int >= 1, got True"),
        (dict(min_tokens=-1), "min_tokens must be an int >= 0, got -1"),
        (
            dict(max_tokens=4, min_tokens=5),
            "min_tokens must be <= max_tokens, got min_tokens=5 and max_tokens=4",
        ),
        (dict(logprobs=-1), "logprobs must be None or an int in [0, 20], got -1"),
        (dict(logprobs=21), "logprobs must be None or an int in [0, 20], got 21"),
        (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
        (dict(ignore_eos=1), "ignore_eos must be True or False, got 1"),
        (
            dict(include_stop_str_in_output=None),
            "include_stop_str_in_output must be True or False, got None",
        ),
        (
            dict(skip_special_tokens="False"),
            "skip_special_tokens must be True or False, got 'False'",
        ),
        (dict(stop=42), "stop must be None, a str or a list of str, got 42"),
        (dict(stop={"a"}), "stop must be None, a str or a list of str, got {'a'}"),
        (dict(stop=["a", 1]), "stop must be None, a str or a list of str, got ['a', 1]"),
        (dict(stop=["a", ""]), "stop strings must be non-empty, got ['a', '']"),
        (
            dict(stop_token_ids=[1, "2"]),
            "stop_token_ids must be None or a list of ints in [0, 2**63 - 1], got [1, '2']",
        ),
        (
            dict(stop_token_ids=[1.0]),
            "stop_token_ids must be None or a list of ints in [0, 2**63 - 1], got [1.0]",
        ),
        (
            dict(stop_token_ids=[True]),
            "stop_token_ids must be None or a list of ints in [0, 2**63 - 1], got [True]",
        ),
        (
            dict(stop_token_ids=[-1]),
            "stop_token_ids must be None or a list of ints in [0, 2**63 - 1], got [-1]",
        ),
        (
            dict(stop_token_ids=[2**63]),
            "stop_token_ids must be None or a list of ints in [0, 2**63 - 1], "
            "got [9223372036854775808]",
        ),
        (
            dict(stop_token_ids=3),
            "stop_token_ids must be None or a list of ints in [0, 2**63 - 1], got 3",
        ),
    ],
)
def test_invalid_values_raise_with_what_was_given_and_what_is_allowed(kwargs, expected_message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == expected_message


# ---- properties: every invalid value of a field is a ValueError naming it ----

NOT_NUMBERS = st.one_of(
    st.none(), st.booleans(), st.text(max_size=3), st.lists(st.integers(), max_size=2)
)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf, 10**400])


def floats_outside(low: float, high: float, low_open: bool = False) -> st.SearchStrategy:
    def inside(x: float) -> bool:
        return (low < x if low_open else low <= x) and x <= high

    return st.one_of(st.floats().filter(lambda x: not inside(x)), NOT_NUMBERS, NON_FINITE)


def ints_outside(low: int, high: int | None) -> st.SearchStrategy:
    outside = st.integers(max_value=low - 1)
    if high is not None:
        outside = st.one_of(outside, st.integers(min_value=high + 1))
    return st.one_of(outside, st.floats(), NOT_NUMBERS.filter(lambda v: v is not None))


INVALID = {
    "n": st.one_of(ints_outside(1, None), st.none()),
    "temperature": floats_outside(0, FLOAT32_MAX),
    "top_p": floats_outside(0, 1, low_open=True),
    "top_k": st.one_of(ints_outside(-1, MAX_TOP_K), st.none()),
    "min_p": floats_outside(0, 1),
    "presence_penalty": floats_outside(-2, 2),
    "frequency_penalty": floats_outside(-2, 2),
    "repetition_penalty": floats_outside(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    "seed": ints_outside(MIN_SEED, MAX_SEED),
    "max_tokens": ints_outside(1, None),
    "min_tokens": st.one_of(ints_outside(0, None), st.none()),
    "logprobs": ints_outside(0, MAX_LOGPROBS),
    "ignore_eos": st.one_of(st.integers(), st.text(), st.none(), st.floats()),
    "include_stop_str_in_output": st.one_of(st.integers(), st.text(), st.none()),
    "skip_special_tokens": st.one_of(st.integers(), st.text(), st.none()),
    "structured_outputs": st.one_of(
        st.integers(), st.text(), st.dictionaries(st.text(max_size=3), st.text(max_size=3))
    ),
    # the enum's values as plain ints, its names as text: only the enum itself is one
    "output_kind": st.one_of(st.integers(), st.text(), st.none(), st.floats()),
    "stop": st.one_of(
        st.integers(),
        st.floats(),
        st.lists(st.one_of(st.integers(), st.none(), st.just("")), min_size=1, max_size=3),
        st.lists(st.text(), max_size=2).map(lambda s: [*s, ""]),
        st.sets(st.text(min_size=1), min_size=1, max_size=2),
    ),
    "stop_token_ids": st.one_of(
        st.integers(),
        st.text(),
        st.lists(
            st.one_of(
                st.integers(max_value=-1),
                st.integers(min_value=MAX_TOKEN_ID + 1),
                st.booleans(),
                st.floats(),
                st.text(),
            ),
            min_size=1,
            max_size=3,
        ).map(lambda bad: [0, *bad]),
    ),
}


def test_every_field_has_an_invalid_strategy():
    assert set(INVALID) == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("field", sorted(INVALID))
@given(data=st.data())
def test_invalid_values_raise_a_value_error_naming_the_field(field, data):
    value = data.draw(INVALID[field], label=field)
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert str(error.value).startswith(f"{field} ")
    assert str(error.value).endswith(f"got {value!r}")


@given(
    seed=st.integers(min_value=MIN_SEED, max_value=MAX_SEED),
    n=st.integers(min_value=1, max_value=2**70),
)
def test_seed_with_n_is_valid_exactly_when_every_completion_seed_fits(seed, n):
    fits = seed + n - 1 <= MAX_SEED
    if fits:
        assert SamplingParams(seed=seed, n=n).seed == seed
    else:
        with pytest.raises(ValueError, match=rf"^seed must .* here n={n}\), got {seed}$"):
            SamplingParams(seed=seed, n=n)


# ---- the sampler accepts every params that validation accepts ----

VOCAB = 32


def valid_params(draw: st.DrawFn) -> SamplingParams:
    n = draw(st.integers(1, 3))
    seed_at = st.sampled_from([MIN_SEED, -1, 0, MAX_SEED - (n - 1)])
    max_tokens = draw(st.one_of(st.none(), st.integers(1, 8)))
    return SamplingParams(
        n=n,
        temperature=draw(st.one_of(st.just(0.0), st.floats(0, FLOAT32_MAX))),
        top_p=draw(st.floats(0, 1, exclude_min=True)),
        top_k=draw(st.one_of(st.sampled_from([-1, 0, 1, VOCAB, MAX_TOP_K]), st.integers(1, VOCAB))),
        min_p=draw(st.floats(0, 1)),
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(
            st.one_of(
                st.sampled_from([MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]),
                st.floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
            )
        ),
        seed=draw(st.one_of(st.none(), seed_at, st.integers(MIN_SEED, MAX_SEED - (n - 1)))),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, 8 if max_tokens is None else max_tokens)),
        # token 0 is a stop token: a NaN row would argmax to it, which min_tokens forbids
        stop_token_ids=[0, *draw(st.lists(st.integers(1, VOCAB - 1), max_size=3))],
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, MAX_LOGPROBS))),
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_sampler_accepts_every_valid_params(data):
    params = data.draw(st.composite(valid_params)(), label="params")
    rows = params.n
    logits = 30 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1))
    num_output = data.draw(st.integers(0, 3), label="num_output")
    states = [
        SamplingState(
            params,
            prompt_token_ids=list(range(1, VOCAB, 2)),
            output_token_ids=list(range(2, 2 + num_output)),
            generator=make_generator(params.seed, index, "cpu"),
            eos_token_ids=[VOCAB - 1],
        )
        for index in range(rows)
    ]
    out = Sampler()(logits, states)
    assert len(out.token_ids) == rows
    # no row asks for logprobs: none are computed
    assert (out.logprobs is None) == (params.logprobs is None)
    logprobs = out.logprobs or [0.0] * rows
    for token_id, logprob in zip(out.token_ids, logprobs, strict=True):
        assert 0 <= token_id < VOCAB
        assert math.isfinite(logprob)
        if num_output < params.min_tokens:
            assert token_id not in params.stop_token_ids
            assert params.ignore_eos or token_id != VOCAB - 1
    for top in out.top_logprobs:
        if params.logprobs is None:
            assert top is None
        else:
            assert len(top) == params.logprobs
            assert all(math.isfinite(value) for _, value in top)


def test_largest_temperature_with_min_tokens_samples_uniformly_without_nan():
    # temperature=inf used to give NaN rows here, which always sampled token 0
    params = SamplingParams(temperature=FLOAT32_MAX, min_tokens=4, stop_token_ids=[0], seed=5)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    generator = make_generator(params.seed, 0, "cpu")
    tokens = [
        Sampler()(logits, [SamplingState(params, [3], [], generator)]).token_ids[0]
        for _ in range(400)
    ]
    assert 0 not in tokens
    assert len(set(tokens)) == VOCAB - 1  # every other token turns up in 400 uniform draws


@pytest.mark.parametrize("seed", [MIN_SEED, MAX_SEED - 2])
def test_seed_at_both_ends_gives_n_reproducible_distinct_streams(seed):
    params = SamplingParams(seed=seed, n=3)
    logits = torch.zeros(3, VOCAB)

    def draws() -> list[list[int]]:
        generators = [make_generator(params.seed, i, "cpu") for i in range(params.n)]
        states = [SamplingState(params, [1], [], g) for g in generators]
        return [Sampler()(logits, states).token_ids for _ in range(8)]

    first = draws()
    assert first == draws()
    columns = {tuple(step[i] for step in first) for i in range(3)}
    assert len(columns) == 3  # each completion its own stream


def test_top_k_at_its_bound_keeps_every_token():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)).repeat(2, 1)
    states = [
        SamplingState(SamplingParams(top_k=top_k, seed=9), [], [], make_generator(9, 0, "cpu"))
        for top_k in (MAX_TOP_K, 0)
    ]
    sampler = Sampler()
    draws = [sampler(logits, states).token_ids for _ in range(20)]  # one top_k column, both rows
    assert all(bounded == off for bounded, off in draws)
    assert len({bounded for bounded, _ in draws}) > 1
