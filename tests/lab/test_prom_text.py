"""The scrape helpers against brute force, and the exposition-text parser against text that
prometheus_client itself writes."""

from __future__ import annotations

import bisect
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from minillm.lab import serving_metrics as sm
from minillm.lab.prom_text import (
    VLLM_TTFT_BUCKETS_S,
    bucket_increase,
    counter_samples,
    cumulative_buckets,
    histogram_buckets,
)


@given(st.lists(st.floats(0, 10), max_size=30), st.lists(st.floats(0, 10), max_size=10))
def test_counter_samples_count_the_events_so_far(events, scrapes):
    samples = counter_samples(events, scrapes)
    assert [t for t, _ in samples] == sorted(scrapes)
    for t, value in samples:
        assert value == len([e for e in events if e <= t])


def test_a_counter_rate_from_scrapes_is_the_event_rate():
    events = [0.1 * k for k in range(1, 101)]  # 10 events a second for 10 s
    samples = counter_samples(events, [0.0, 2.5, 5.0, 7.5, 10.0])
    assert [v for _, v in samples] == [0.0, 25.0, 50.0, 75.0, 100.0]
    assert sm.counter_rate(samples) == pytest.approx(10.0)


@given(st.lists(st.floats(0.0005, 3000), min_size=1, max_size=40), st.floats(0.01, 1))
def test_buckets_hold_cumulative_counts_and_the_quantile_stays_in_its_bucket(values, q):
    buckets = cumulative_buckets(values, VLLM_TTFT_BUCKETS_S)
    assert buckets[-1] == (math.inf, float(len(values)))
    for le, count in buckets:
        assert count == sum(v <= le for v in values)
    estimate = sm.histogram_quantile(q, buckets)
    exact = sm.percentile(values, 100 * q)
    # the estimate lies in the bucket that holds the exact value (or at the top finite bound)
    bounds = (0.0, *VLLM_TTFT_BUCKETS_S)
    b = bisect.bisect_left(bounds, exact)
    if b < len(bounds):
        assert bounds[b - 1] - 1e-12 <= estimate <= bounds[b] + 1e-12
    else:
        assert estimate == VLLM_TTFT_BUCKETS_S[-1]


def test_bucket_bounds_must_increase():
    with pytest.raises(ValueError, match="increase"):
        cumulative_buckets([0.1], [0.5, 0.2])


def exposition(values_by_model: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    h = Histogram(
        "vllm:time_to_first_token_seconds",
        "TTFT",
        ["model_name"],
        buckets=VLLM_TTFT_BUCKETS_S,
        registry=registry,
    )
    for model, values in values_by_model.items():
        for v in values:
            h.labels(model).observe(v)
    return generate_latest(registry).decode()


@given(
    st.lists(st.floats(0.0005, 3000), min_size=1, max_size=20),
    st.lists(st.floats(0.0005, 3000), max_size=20),
)
def test_parsed_buckets_are_the_observations_summed_over_labels(a, b):
    parsed = histogram_buckets(exposition({"a": a, "b": b}), "vllm:time_to_first_token_seconds")
    assert parsed == cumulative_buckets(a + b, VLLM_TTFT_BUCKETS_S)


def test_the_increase_between_two_scrapes_is_the_histogram_of_what_came_between():
    first, later = [0.03, 0.2], [0.07, 0.07, 1.5]
    before = cumulative_buckets(first, VLLM_TTFT_BUCKETS_S)
    after = cumulative_buckets(first + later, VLLM_TTFT_BUCKETS_S)
    assert bucket_increase(before, after) == cumulative_buckets(later, VLLM_TTFT_BUCKETS_S)


def test_bad_scrapes_are_rejected():
    with pytest.raises(ValueError, match="no histogram"):
        histogram_buckets(exposition({"a": [0.1]}), "vllm:e2e_request_latency_seconds")
    short = cumulative_buckets([0.1], (0.5, 1.0))
    with pytest.raises(ValueError, match="bounds"):
        bucket_increase(short, cumulative_buckets([0.1], (0.5, 2.0)))
    with pytest.raises(ValueError, match="restarted"):
        bucket_increase(cumulative_buckets([0.1, 0.2], (0.5,)), cumulative_buckets([0.1], (0.5,)))
