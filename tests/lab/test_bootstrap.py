"""minillm.lab.bootstrap against the exact bootstrap distribution (every resample enumerated)
and against the closed-form variance of a resampled mean."""

import bisect
import itertools
import math

import pytest
import torch

from minillm.lab.bootstrap import Interval, bootstrap_interval, perplexity_difference


def mean_of_column(col):
    return lambda batch: batch[..., col].mean(dim=1)


def exact_distribution(values, statistic):
    """Every one of the W^W ordered resamples, each equally likely: the bootstrap
    distribution the random resamples estimate."""
    w = len(values)
    out = []
    for rows in itertools.product(range(w), repeat=w):
        out.append(statistic([values[i] for i in rows]))
    return sorted(out)


def assert_is_quantile(sorted_values, q, end, slack=0.005):
    """`end` is a q-quantile of the equally weighted discrete distribution, up to `slack` in
    probability (the random resamples' own noise): at most q + slack of the mass lies below
    it and at least q - slack at or below it."""
    n = len(sorted_values)
    below = bisect.bisect_left(sorted_values, end - 1e-9) / n
    at_or_below = bisect.bisect_right(sorted_values, end + 1e-9) / n
    assert below <= q + slack and at_or_below >= q - slack, (q, end, below, at_or_below)


def test_interval_matches_the_enumerated_bootstrap():
    values = [0.3, 1.7, -0.4, 2.9, 0.8]  # 5^5 = 3,125 resamples, enumerated
    exact = exact_distribution(values, lambda v: sum(v) / len(v))
    got = bootstrap_interval(
        torch.tensor(values, dtype=torch.float64), mean_of_column(0), num_resamples=40_000
    )
    assert got.estimate == pytest.approx(sum(values) / 5)
    for q, end in ((0.025, got.low), (0.975, got.high)):
        assert_is_quantile(exact, q, end)


def test_paired_difference_matches_the_enumerated_bootstrap():
    """Two variants on the same 5 windows: the rows are resampled together."""
    a = [2.0, 2.5, 1.0, 3.0, 2.2]
    b = [2.1, 2.4, 1.3, 3.1, 2.2]

    def gap(rows):
        return math.exp(sum(r[0] for r in rows) / 5) - math.exp(sum(r[1] for r in rows) / 5)

    exact = exact_distribution(list(zip(a, b, strict=True)), gap)
    got = perplexity_difference(
        torch.tensor(a, dtype=torch.float64),
        torch.tensor(b, dtype=torch.float64),
        num_resamples=40_000,
    )
    assert got.estimate == pytest.approx(gap(list(zip(a, b, strict=True))))
    for q, end in ((0.025, got.low), (0.975, got.high)):
        assert_is_quantile(exact, q, end)
    # B is above A on 3 windows, below on 1: every resample's gap is small, but the
    # enumeration puts mass on both sides of zero, and so does the interval
    assert exact[0] < 0 < exact[-1]
    assert not got.excludes_zero


def test_spread_matches_the_closed_form_for_a_mean():
    """The bootstrap variance of a mean of W draws is sigma^2 / W with sigma^2 the data's
    variance (divided by W): the 95% percentile interval is close to +-1.96 of its root."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(200, generator=gen).double() * 3 + 1
    sd = float(values.var(unbiased=False).sqrt() / math.sqrt(200))
    got = bootstrap_interval(values, mean_of_column(0), num_resamples=20_000)
    assert (got.high - got.low) / 2 == pytest.approx(1.96 * sd, rel=0.05)
    assert (got.high + got.low) / 2 == pytest.approx(float(values.mean()), abs=0.1 * sd)


def test_intervals_are_reproducible_and_checked():
    values = torch.tensor([1.0, 2.0, 4.0])
    first = bootstrap_interval(values, mean_of_column(0), num_resamples=300, seed=4)
    assert first == bootstrap_interval(values, mean_of_column(0), num_resamples=300, seed=4)
    assert first.low <= first.estimate <= first.high
    assert not Interval(0.1, -0.2, 0.3, 0.95, 10).excludes_zero
    assert Interval(-0.5, -0.9, -0.1, 0.95, 10).excludes_zero
    with pytest.raises(ValueError, match="W >= 2"):
        bootstrap_interval(torch.tensor([1.0]), mean_of_column(0))
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval(values, mean_of_column(0), level=1.0)
    with pytest.raises(ValueError, match="same windows"):
        perplexity_difference(torch.ones(3), torch.ones(4))


def test_verdicts_follow_the_interval():
    from minillm.lab.bootstrap import verdict

    assert verdict(Interval(-0.1, -0.2, -0.01, 0.95, 10), "GPTQ", "RTN") == (
        "GPTQ beats RTN (the interval excludes zero)"
    )
    assert verdict(Interval(0.1, 0.02, 0.2, 0.95, 10), "GPTQ", "RTN") == (
        "RTN beats GPTQ (the interval excludes zero)"
    )
    assert verdict(Interval(0.1, 0.02, 0.2, 0.95, 10), "A", "B", lower_is_better=False) == (
        "A beats B (the interval excludes zero)"
    )
    assert verdict(Interval(-0.1, -0.2, 0.01, 0.95, 10), "AWQ", "RTN") == (
        "AWQ and RTN are not separated (the interval includes zero)"
    )
