"""The serving metrics against hand-derived values, numpy and brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab import serving_metrics as sm

# start 0; tokens at 0.5, 0.6, 0.8, 1.1; the response ends at 1.2
START, TIMES, END = 0.0, [0.5, 0.6, 0.8, 1.1], 1.2


def test_one_request_by_hand():
    assert sm.ttft_s(START, TIMES) == pytest.approx(0.5)
    assert sm.itl_s(TIMES) == pytest.approx([0.1, 0.2, 0.3])
    assert sm.e2el_s(START, END) == pytest.approx(1.2)
    assert sm.tpot_s(START, TIMES, END) == pytest.approx((1.2 - 0.5) / 3)
    assert sm.tpot_incl_first_s(START, TIMES, END) == pytest.approx(1.2 / 4)
    assert sm.worst_gap_s(TIMES) == pytest.approx(0.3)


def test_one_token_has_no_tpot_and_no_gap():
    assert sm.tpot_s(0.0, [0.4], 0.5) is None
    assert sm.worst_gap_s([0.4]) is None
    assert sm.itl_s([0.4]) == []


@pytest.mark.parametrize(
    "call",
    [
        lambda: sm.ttft_s(0.0, []),
        lambda: sm.ttft_s(1.0, [0.5]),
        lambda: sm.tpot_s(0.0, [0.5, 0.4], 1.0),
        lambda: sm.e2el_s(1.0, 0.5),
        lambda: sm.percentile([], 50),
        lambda: sm.percentile([1.0], 101),
        lambda: sm.goodput_rps([], sm.Slo(), 0.0),
        lambda: sm.mean_in_flight([], 1.0, 1.0),
        lambda: sm.counter_rate([(0.0, 1.0)]),
        lambda: sm.histogram_quantile(0.5, [(1.0, 3)]),
        lambda: sm.histogram_quantile(1.5, [(1.0, 3), (math.inf, 3)]),
        lambda: sm.histogram_quantile(0.5, [(1.0, 3), (0.5, 4), (math.inf, 4)]),
        lambda: sm.knee_index([]),
    ],
)
def test_bad_input_is_refused(call):
    with pytest.raises(ValueError):
        call()


sorted_times = st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=30).map(sorted)


@given(sorted_times, st.floats(0, 10))
def test_tpot_and_ttft_add_up_to_e2el(times, tail):
    start, end = times[0] - 0.25, times[-1] + tail
    n = len(times)
    e2el = sm.e2el_s(start, end)
    if n >= 2:
        assert sm.ttft_s(start, times) + (n - 1) * sm.tpot_s(start, times, end) == pytest.approx(
            e2el, abs=1e-9
        )
        assert sum(sm.itl_s(times)) == pytest.approx(times[-1] - times[0], abs=1e-9)
        assert sm.worst_gap_s(times) == max(b - a for a, b in zip(times, times[1:], strict=False))
    assert n * sm.tpot_incl_first_s(start, times, end) == pytest.approx(e2el, abs=1e-9)


def test_percentile_by_hand():
    assert sm.percentile(range(1, 101), 99) == 99
    assert sm.percentile(range(1, 101), 50) == 50
    assert sm.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert sm.percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert sm.percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert sm.percentile([5.0, 1.0], 50) == 1.0  # an observed value, never the mean 3.0
    assert sm.percentile(range(1, 101), 7) == 7  # 7 * 100 / 100 exactly, no float rounding up


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.integers(0, 100),
)
def test_percentile_is_numpys_inverted_cdf(values, p):
    expected = np.percentile(np.array(values), p, method="inverted_cdf")
    assert sm.percentile(values, p) == expected


@given(
    st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=50),
    st.integers(1, 100),
)
def test_percentile_is_met_by_at_least_p_percent(values, p):
    v = sm.percentile(values, p)
    assert sum(x <= v for x in values) * 100 >= p * len(values)
    assert sum(x < v for x in values) * 100 < p * len(values)


def timing(start, times, end, ok=True, sent=None):
    return sm.RequestTiming(start, start if sent is None else sent, tuple(times), end, ok)


def test_goodput_by_hand():
    timings = [
        timing(0.0, [0.1, 0.2, 0.3], 0.3),  # ttft 0.1, tpot 0.1: meets
        timing(0.0, [0.6, 0.7], 0.7),  # ttft 0.6: misses TTFT
        timing(1.0, [1.1, 1.5, 1.9], 1.9),  # tpot 0.4: misses TPOT
        timing(1.0, [1.2], 1.2),  # one token: no TPOT, meets
        timing(1.0, [], 3.0, ok=False),  # failed
    ]
    slo = sm.Slo(ttft_s=0.5, tpot_s=0.2)
    assert [sm.meets_slo(t, slo) for t in timings] == [True, False, False, True, False]
    assert sm.goodput_rps(timings, slo, 2.0) == pytest.approx(1.0)
    assert sm.goodput_rps(timings, sm.Slo(e2el_s=0.5), 2.0) == pytest.approx(1.0)
    assert sm.goodput_rps(timings, sm.Slo(), 2.0) == pytest.approx(2.0)


def test_late_sends():
    timings = [timing(0.0, [0.1], 0.1, sent=0.0), timing(0.5, [0.9], 1.0, sent=0.8)]
    assert sm.late_sends(timings, 0.01) == [1]
    assert sm.late_sends(timings, 0.5) == []


def test_littles_law_by_hand():
    intervals = [(0.0, 2.0), (1.0, 3.0)]
    assert sm.mean_in_flight(intervals, 0.0, 4.0) == pytest.approx(1.0)
    assert sm.littles_law_l(intervals, 0.0, 4.0) == pytest.approx(2 / 4 * 2.0)


@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 5)), min_size=1, max_size=20))
def test_littles_law_holds_when_everything_ends_in_the_window(pairs):
    intervals = [(a, a + d) for a, d in pairs]
    t1 = max(b for _, b in intervals) + 1.0
    assert sm.mean_in_flight(intervals, 0.0, t1) == pytest.approx(
        sm.littles_law_l(intervals, 0.0, t1), rel=1e-9, abs=1e-12
    )
    # brute force: in flight at the midpoints of a fine grid
    grid = np.linspace(0.0, t1, 20001)
    mid = (grid[1:] + grid[:-1]) / 2
    counted = sum(((mid >= a) & (mid < b)).astype(float) for a, b in intervals).mean()
    assert sm.mean_in_flight(intervals, 0.0, t1) == pytest.approx(counted, abs=len(pairs) * 2e-4)


BUCKETS = [(0.1, 2), (0.5, 6), (1.0, 8), (math.inf, 10)]


def test_histogram_quantile_by_hand():
    assert sm.histogram_quantile(0.5, BUCKETS) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert sm.histogram_quantile(0.1, BUCKETS) == pytest.approx(0.1 * 1 / 2)
    assert sm.histogram_quantile(0.8, BUCKETS) == pytest.approx(1.0)
    assert sm.histogram_quantile(0.95, BUCKETS) == 1.0  # in +Inf: the highest finite bound
    assert math.isnan(sm.histogram_quantile(0.5, [(0.1, 0), (math.inf, 0)]))


@given(
    st.lists(st.floats(0.001, 20.0), min_size=1, max_size=60),
    st.floats(0.01, 0.99),
)
def test_histogram_quantile_is_within_the_bucket_of_the_true_quantile(values, q):
    bounds = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
    buckets = [(b, sum(v <= b for v in values)) for b in bounds] + [(math.inf, len(values))]
    got = sm.histogram_quantile(q, buckets)
    true = sm.percentile(values, q * 100)
    upper = next((b for b in bounds if true <= b), math.inf)
    lower = max((b for b in bounds if b < upper), default=0.0)
    if upper == math.inf:
        assert got == bounds[-1]
    else:
        assert lower - 1e-12 <= got <= upper + 1e-12


def test_counter_rate_handles_a_reset():
    assert sm.counter_rate([(0, 10), (10, 30)]) == pytest.approx(2.0)
    assert sm.counter_rate([(0, 10), (10, 30), (20, 5), (30, 15)]) == pytest.approx(35 / 30)


def test_knee():
    assert sm.knee_index([1.0, 1.1, 1.5, 2.5, 9.0]) == 2
    assert sm.knee_index([1.0, 1.1, 1.2]) == 2
    assert sm.knee_index([1.0, 5.0]) == 0
