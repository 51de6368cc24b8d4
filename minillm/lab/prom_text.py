"""Prometheus metrics as a scraper sees them: counters read at scrape times, histograms as
cumulative buckets, and the exposition text a server serves at /metrics parsed back.

A histogram's buckets only ever grow, so the histogram of one run is the difference of two
scrapes, one before and one after it (`bucket_increase`): the same subtraction PromQL's
`rate()` makes, without the division by the window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def counter_samples(event_times_s: Sequence[float], scrape_times_s: Sequence[float]):
    """What a scraper reads from a counter that adds 1 at each event time: (t, events <= t)
    at each scrape time, as Prometheus stores a counter such as generated tokens."""
    ordered = sorted(event_times_s)
    samples, k = [], 0
    for t in sorted(scrape_times_s):
        while k < len(ordered) and ordered[k] <= t:
            k += 1
        samples.append((t, float(k)))
    return samples


def cumulative_buckets(values: Sequence[float], bounds: Sequence[float]):
    """A Prometheus histogram of `values`: (le, number of values <= le) for each finite upper
    bound in increasing order, then (+Inf, all of them)."""
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError("bucket bounds must increase")
    return [(b, float(sum(v <= b for v in values))) for b in bounds] + [
        (math.inf, float(len(values)))
    ]


# vLLM V1's bucket bounds (s) for vllm:time_to_first_token_seconds and
# vllm:inter_token_latency_seconds (vllm/v1/metrics/loggers.py)
VLLM_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


def histogram_buckets(text: str, name: str) -> list[tuple[float, float]]:
    """The buckets (le, cumulative count) of histogram `name` in Prometheus exposition text,
    summed over its label sets (`sum by (le)`), in increasing order of le."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                counts[le] = counts.get(le, 0.0) + sample.value
    if not counts:
        raise ValueError(f"no histogram named {name!r} in the text")
    return sorted(counts.items())


def bucket_increase(
    before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The histogram of what was observed between two scrapes of the same histogram."""
    if [le for le, _ in before] != [le for le, _ in after]:
        raise ValueError("the two scrapes have different bucket bounds")
    if any(b < a for (_, a), (_, b) in zip(before, after, strict=True)):
        raise ValueError("a bucket shrank between the scrapes: the server restarted")
    return [(le, b - a) for (le, a), (_, b) in zip(before, after, strict=True)]
