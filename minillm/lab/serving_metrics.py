"""Serving metrics as pure functions of timestamps, counts and Prometheus buckets.

Everything `minillm bench serve` reports is computed here, from numbers a test (or an
exercise) can write down by hand. One request is measured by

    start      when the request counts as sent: its *scheduled* time in an open-loop run,
               so that a late send is counted as latency (no coordinated omission)
    t[0..k-1]  when each streamed chunk with output reached the client
    n          how many output tokens the request produced (the server's usage count, else
               the received text re-tokenized); k = n only when every chunk holds one token
    end        when the response ended; `minillm bench serve` takes the last chunk's arrival,
               as vLLM's benchmark does (0.11, `vllm/benchmarks/lib/endpoint_request_func.py`:
               `latency = most_recent_timestamp - st`), so the usage chunk and `[DONE]` after
               the last token count in no latency

and every latency is a difference of these (seconds):

    TTFT            = t[0] - start                       time to first token
    ITL gaps (TBT)  = t[i] - t[i-1], i = 1 .. k-1        one gap per chunk after the first
    E2EL            = end - start                        end-to-end latency
    TPOT            = (E2EL - TTFT) / (n - 1)            time per output token, first excluded
    TPOT incl.      = E2EL / n                           the minority convention, first included
    worst gap       = max over the ITL gaps of one stream

TPOT divides by tokens, ITL by chunks: a server that sends four tokens a chunk has ITL gaps
four decode steps long and a TPOT of one step (vLLM 0.11's `calculate_metrics` in
`vllm/benchmarks/serve.py` does the same: `output_tokens` from usage, else the tokenizer).

Percentiles are nearest-rank: the p-th percentile of N values is the smallest value that at
least p % of them do not exceed, always one of the values (`percentile`).

These mirror the engine's own per-request metrics (`minillm.core.metrics.RequestMetrics`:
`ttft_s`, `itl_s`, `e2el_s`, `tpot_s`), which the engine stamps as it runs; here the same
quantities come from the client's timestamps, so they include the network and the server's
queues, and work for any server.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise


def _check_times(start_s: float, token_times_s: Sequence[float]) -> None:
    if not token_times_s:
        raise ValueError("a request with no output token has no TTFT, ITL or TPOT")
    if token_times_s[0] < start_s:
        raise ValueError(f"the first token ({token_times_s[0]}) precedes the start ({start_s})")
    if any(b < a for a, b in pairwise(token_times_s)):
        raise ValueError("token times must not decrease")


def ttft_s(start_s: float, token_times_s: Sequence[float]) -> float:
    """Time to first token: the first token's arrival minus the request's start."""
    _check_times(start_s, token_times_s)
    return token_times_s[0] - start_s


def itl_s(token_times_s: Sequence[float]) -> list[float]:
    """Inter-token latencies: the n - 1 gaps between consecutive tokens (TBT_i, one per token
    after the first). vLLM's benchmark reports these as its ITL."""
    return [b - a for a, b in pairwise(token_times_s)]


def e2el_s(start_s: float, end_s: float) -> float:
    """End-to-end latency: from the request's start to the end of its response."""
    if end_s < start_s:
        raise ValueError(f"the end ({end_s}) precedes the start ({start_s})")
    return end_s - start_s


def _num_tokens(token_times_s: Sequence[float], num_tokens: int | None) -> int:
    if num_tokens is None:
        return len(token_times_s)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    return num_tokens


def tpot_s(
    start_s: float, token_times_s: Sequence[float], end_s: float, num_tokens: int | None = None
) -> float | None:
    """Time per output token after the first: (E2EL - TTFT) / (n - 1); None when n = 1.

    n is `num_tokens` (the request's output tokens), or one token per chunk when it is None.
    The convention of vLLM's and SGLang's benchmarks and of GenAI-Perf's ITL: the first
    token's time is TTFT's, so it is left out, and n tokens leave n - 1 gaps.
    """
    _check_times(start_s, token_times_s)
    n = _num_tokens(token_times_s, num_tokens)
    if n < 2:
        return None
    return (e2el_s(start_s, end_s) - ttft_s(start_s, token_times_s)) / (n - 1)


def tpot_incl_first_s(
    start_s: float, token_times_s: Sequence[float], end_s: float, num_tokens: int | None = None
) -> float:
    """The other convention: E2EL / n, the first token (and with it TTFT) included."""
    _check_times(start_s, token_times_s)
    return e2el_s(start_s, end_s) / _num_tokens(token_times_s, num_tokens)


def worst_gap_s(token_times_s: Sequence[float]) -> float | None:
    """The longest pause between two tokens of one stream; None for fewer than 2 tokens."""
    gaps = itl_s(token_times_s)
    return max(gaps) if gaps else None


def percentile(values: Iterable[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value v such that at least p % of the values are
    <= v, i.e. sorted(values)[ceil(p * N / 100) - 1] (the minimum for p = 0).

    Unlike numpy's default (linear interpolation between neighbours), the result is always an
    observed value, and "p99 TTFT is x" means exactly that 99 % of requests waited at most x.
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the percentile of no values is undefined")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be between 0 and 100, got {p}")
    rank = max(1, math.ceil(p * len(ordered) / 100))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """What the client saw of one request (seconds on the run's clock)."""

    scheduled_s: float  # when the workload said to send it
    sent_s: float  # when the client actually sent it (>= scheduled_s when it was late)
    token_times_s: tuple[float, ...]  # arrival of each output chunk
    end_s: float  # end of the response
    ok: bool = True  # False: an error, no latency is counted
    num_tokens: int | None = None  # output tokens; None: one per chunk


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets (seconds); None means no target on that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None


def meets_slo(timing: RequestTiming, slo: Slo) -> bool:
    """Whether a completed request met every target of `slo` (latency from its schedule)."""
    if not timing.ok or not timing.token_times_s:
        return False
    start = timing.scheduled_s
    if slo.ttft_s is not None and ttft_s(start, timing.token_times_s) > slo.ttft_s:
        return False
    tpot = tpot_s(start, timing.token_times_s, timing.end_s, timing.num_tokens)
    if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
        return False
    return slo.e2el_s is None or e2el_s(start, timing.end_s) <= slo.e2el_s


def goodput_rps(timings: Sequence[RequestTiming], slo: Slo, duration_s: float) -> float:
    """Requests per second that completed *and* met every SLO, over the run's duration."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    return sum(meets_slo(t, slo) for t in timings) / duration_s


def late_sends(timings: Sequence[RequestTiming], tolerance_s: float) -> list[int]:
    """Indices of requests sent more than `tolerance_s` after their scheduled time.

    In an open-loop run each one is a symptom of coordinated omission: the client stopped
    sending on schedule, so a latency measured from the send would hide the wait.
    """
    return [i for i, t in enumerate(timings) if t.sent_s - t.scheduled_s > tolerance_s]


def mean_in_flight(intervals: Sequence[tuple[float, float]], t0_s: float, t1_s: float) -> float:
    """L of Little's law measured directly: the time average over [t0, t1] of the number of
    requests in the system, each present from its start to its end."""
    if t1_s <= t0_s:
        raise ValueError(f"the window [{t0_s}, {t1_s}] is empty")
    busy = sum(max(0.0, min(b, t1_s) - max(a, t0_s)) for a, b in intervals)
    return busy / (t1_s - t0_s)


def littles_law_l(intervals: Sequence[tuple[float, float]], t0_s: float, t1_s: float) -> float:
    """L predicted as λW: requests that arrived in [t0, t1] per second, times their mean time
    in the system. Equals `mean_in_flight` when every request starts and ends in the window."""
    inside = [(a, b) for a, b in intervals if t0_s <= a <= t1_s]
    if not inside:
        raise ValueError("no request arrived in the window")
    arrival_rate = len(inside) / (t1_s - t0_s)
    return arrival_rate * statistics.fmean(b - a for a, b in inside)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile on one histogram: `buckets` are (le, cumulative count)
    sorted by upper bound `le`, the last one +Inf.

    Finds the bucket holding the rank q * total and interpolates linearly inside it, from the
    previous bound (0 for the first bucket) to its own: the answer is exact only at bucket
    bounds, wrong by at most a bucket's width. A rank in the +Inf bucket returns the highest
    finite bound. NaN when the histogram is empty.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q must be between 0 and 1, got {q}")
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        raise ValueError("a histogram has at least one finite bucket and ends with le=+Inf")
    if any(b[0] <= a[0] or b[1] < a[1] for a, b in pairwise(buckets)):
        raise ValueError("buckets must have increasing bounds and non-decreasing counts")
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    upper, count = buckets[b]
    if b == 0 and upper <= 0:
        return upper
    lower, below = (buckets[b - 1][0], buckets[b - 1][1]) if b > 0 else (0.0, 0.0)
    if count == below:  # q = 0 and an empty first bucket
        return lower
    return lower + (upper - lower) * (rank - below) / (count - below)


def counter_rate(samples: Sequence[tuple[float, float]]) -> float:
    """Per-second increase of a counter over its samples (time, value), as PromQL's rate()
    computes it without extrapolation to the window's edges: a drop means the process
    restarted from zero, so the value after a drop is all new increase."""
    if len(samples) < 2:
        raise ValueError("rate needs at least two samples")
    increase = 0.0
    for (_, a), (_, b) in pairwise(samples):
        increase += b - a if b >= a else b
    return increase / (samples[-1][0] - samples[0][0])


def knee_index(latencies_s: Sequence[float], factor: float = 2.0) -> int:
    """The knee of a latency-versus-load curve (points in order of increasing load): the last
    point before latency first exceeds `factor` times its value at the lightest load."""
    if not latencies_s:
        raise ValueError("no points")
    if factor <= 1:
        raise ValueError(f"factor must exceed 1, got {factor}")
    limit = factor * latencies_s[0]
    for i, latency in enumerate(latencies_s):
        if latency > limit:
            return max(0, i - 1)
    return len(latencies_s) - 1


def ab_verdict(a: Sequence[float], b: Sequence[float]) -> str:
    """Compare runs of A and B of a higher-is-better metric (a throughput): "B better" when
    the ratio of medians B / A exceeds the A/A spread max(a) / min(a), "B worse" when it is
    below its inverse, else "no difference" (the gap is within what A alone varies by)."""
    if len(a) < 2 or not b:
        raise ValueError("need at least two runs of A (an A/A pair) and one of B")
    if min(a) <= 0 or min(b) <= 0:
        raise ValueError("the metric must be positive")
    ratio = statistics.median(b) / statistics.median(a)
    spread = max(a) / min(a)
    if ratio > spread:
        return "B better"
    if ratio < 1 / spread:
        return "B worse"
    return "no difference"
