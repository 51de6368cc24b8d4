"""Erlang C against the textbook formula written with factorials (exact fractions, no code
shared with the recursion it checks) and against worked values; the discrete-event
simulation against Erlang C where the formula holds and against hand-traced waits."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.lab import queueing


def erlang_c_textbook(c: int, a: Fraction) -> Fraction:
    """C(c, a) = (a^c / c!) (c / (c - a)) / (sum_{k<c} a^k / k! + (a^c / c!) (c / (c - a)))."""
    top = a**c / math.factorial(c) * Fraction(c) / (c - a)
    return top / (sum(a**k / math.factorial(k) for k in range(c)) + top)


def test_worked_values():
    # M/M/1: an arrival waits exactly when the server is busy, probability rho
    assert queueing.erlang_c(1, 0.7) == pytest.approx(0.7)
    # two servers at one Erlang: (1/2 * 2) / (1 + 1 + 1) = 1/3
    assert queueing.erlang_c(2, 1.0) == pytest.approx(1 / 3)
    # M/M/1 at rho 0.5, mean hold 1 s: P(W > t) = 0.5 exp(-0.5 t), p99 = 2 ln(50) s
    assert queueing.wait_quantile_s(1, 0.5, 1.0, 0.99) == pytest.approx(2 * math.log(50))
    # fewer than 1% wait: the p99 wait is 0
    assert queueing.erlang_c(10, 2.0) < 0.01
    assert queueing.wait_quantile_s(10, 2.0, 1.0, 0.99) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    c=st.integers(1, 40),
    rho=st.fractions(min_value=0, max_value=Fraction(99, 100), max_denominator=100),
)
def test_erlang_c_matches_the_factorial_formula(c, rho):
    a = rho * c
    assert queueing.erlang_c(c, float(a)) == pytest.approx(
        float(erlang_c_textbook(c, a)), abs=1e-12
    )


def test_the_chapter_plan_load():
    # 265 seats at 249.5 Erlangs: 24.0% of arrivals wait (the factorial formula in exact
    # arithmetic, which floats could not hold at c = 265)
    a = Fraction(2495, 10)
    assert queueing.erlang_c(265, 249.5) == pytest.approx(
        float(erlang_c_textbook(265, a)), rel=1e-9
    )
    assert queueing.erlang_c(265, 249.5) == pytest.approx(0.240, abs=0.001)


def test_simulation_agrees_with_erlang_c():
    # M/M/4 at 80% utilization, 400,000 arrivals (about 100,000 mean holds per seat)
    rng = np.random.default_rng(7)
    c, hold, rate, n = 4, 1.0, 3.2, 400_000
    arrivals = queueing.poisson_arrivals(rate, n, rng)
    waits = queueing.simulate_waits(arrivals, rng.exponential(hold, n), c)[n // 20 :]
    a = rate * hold
    assert np.mean(waits > 0) == pytest.approx(queueing.erlang_c(c, a), abs=0.01)
    assert np.mean(waits) == pytest.approx(queueing.erlang_c(c, a) * hold / (c - a), rel=0.05)
    for q in (0.9, 0.99):
        assert np.quantile(waits, q) == pytest.approx(
            queueing.wait_quantile_s(c, a, hold, q), rel=0.06
        )


def test_fixed_holds_wait_less_and_bursts_wait_more():
    # at the same utilization, equal lengths (M/D/c) wait less than exponential ones, and
    # Gamma gaps with a squared coefficient of variation of 4 wait more than Poisson ones
    rng = np.random.default_rng(3)
    c, hold, rate, n = 8, 1.0, 7.0, 200_000
    poisson = queueing.poisson_arrivals(rate, n, rng)
    bursty = queueing.gamma_arrivals(rate, 4.0, n, rng)
    fixed = np.full(n, hold)
    p99 = {
        "MMc": queueing.wait_quantile_s(c, rate * hold, hold, 0.99),
        "MDc": np.quantile(queueing.simulate_waits(poisson, fixed, c), 0.99),
        "GDc": np.quantile(queueing.simulate_waits(bursty, fixed, c), 0.99),
    }
    assert p99["MDc"] < 0.8 * p99["MMc"]
    assert p99["GDc"] > 2 * p99["MDc"]
    # the gaps have the asked mean rate and variability
    gaps = np.diff(bursty)
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.02)
    assert np.var(gaps) / np.mean(gaps) ** 2 == pytest.approx(4.0, rel=0.05)


def test_waits_traced_by_hand():
    # two seats; holds 3, 3, 1, 1 at t = 0, 1, 2, 3.5: the third waits for the first seat
    # (free at 3), the fourth finds seat 2 free at 4 (seat 1 is busy until 3 + 1 = 4 too)
    waits = queueing.simulate_waits([0, 1, 2, 3.5], [3, 3, 1, 1], 2)
    assert waits.tolist() == [0, 0, 1, 0.5]
    # a seat that frees exactly at an arrival serves it at once
    assert queueing.simulate_waits([0, 2], [2, 1], 1).tolist() == [0, 0]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="stable"):
        queueing.erlang_c(4, 4.0)
    with pytest.raises(ValueError, match="servers"):
        queueing.erlang_c(0, 0.0)
    with pytest.raises(ValueError, match="q must"):
        queueing.wait_quantile_s(2, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="sorted"):
        queueing.simulate_waits([1, 0], [1, 1], 1)
    with pytest.raises(ValueError, match="one holding time"):
        queueing.simulate_waits([0, 1], [1], 1)
