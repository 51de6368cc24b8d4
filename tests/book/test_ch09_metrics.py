"""The checks of the serving-metrics exercises reject plausible wrong answers.

As for chapter 0: the solution's cells define the functions, then each graded cell runs once
with the solution (it must pass), once with the stub (NotImplementedError), and once per
wrong answer (it must fail with an AssertionError). Each exercise's wrong answers include a
value hard-coded for the worked example, a constant, the right answer of the wrong type and
an answer that changes its input, besides the mistakes the chapter warns about.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time

from .conftest import ROOT
from .exercise_checks import ExerciseChecks


def latencies(tpot_rule):
    def request_latencies(start_s, token_times_s, end_s):
        ttft, e2el = token_times_s[0] - start_s, end_s - start_s
        return {"ttft": ttft, "e2el": e2el, "tpot": tpot_rule(ttft, e2el, len(token_times_s))}

    return request_latencies


def right_tpot(ttft, e2el, n):
    return (e2el - ttft) / (n - 1) if n > 1 else None


def mutating_latencies(start_s, token_times_s, end_s):
    token_times_s.sort(reverse=True)
    token_times_s.reverse()
    token_times_s.append(end_s)
    n = len(token_times_s) - 1
    ttft = token_times_s[0] - start_s
    return {"ttft": ttft, "e2el": end_s - start_s, "tpot": right_tpot(ttft, end_s - start_s, n)}


def gaps_of(times):
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def tpot_of(start, times, end):
    return ((end - start) - (times[0] - start)) / (len(times) - 1)


def aggregate(itl_rule, tpot_rule):
    def mean_itl_and_tpot(requests):
        return itl_rule(requests), tpot_rule(requests)

    return mean_itl_and_tpot


def pooled_itl(requests):
    gaps = [g for _, t, _ in requests for g in gaps_of(t)]
    return sum(gaps) / len(gaps)


def per_request_itl(requests):
    return statistics.fmean(statistics.fmean(gaps_of(t)) for _, t, _ in requests)


def per_request_tpot(requests):
    return statistics.fmean(tpot_of(*r) for r in requests if len(r[1]) > 1)


def pooled_tpot_incl_first(requests):
    return statistics.fmean((e - s) / len(t) for s, t, e in requests)


def rank_rule(index):
    def nearest_rank(values, p):
        ordered = sorted(values)
        return ordered[index(p, len(ordered))]

    return nearest_rank


def in_place_rank(values, p):
    values.sort()
    return values[max(1, math.ceil(p * len(values) / 100)) - 1]


def freeze(share_rule, itl_rule, worst_rule):
    def freeze_report(streams, freeze_s):
        gaps = [gaps_of(t) for t in streams]
        return share_rule(gaps, freeze_s), itl_rule(gaps), worst_rule(gaps)

    return freeze_report


def nr(values, p):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p * len(ordered) / 100)) - 1]


def share_streams(gaps, f):
    return sum(max(g) > f for g in gaps) / len(gaps)


def share_gaps(gaps, f):
    flat = [x for g in gaps for x in g]
    return sum(x > f for x in flat) / len(flat)


def p99_pooled(gaps):
    return nr([x for g in gaps for x in g], 99)


def p99_worst(gaps):
    return nr([max(g) for g in gaps], 99)


def p99_mean_gap(gaps):
    return nr([statistics.fmean(g) for g in gaps], 99)


def goodput_rule(
    count_failed=False, one_token_fails=False, per_request=False, ttft_only=False, to_last=False
):
    def goodput(requests, slo, duration_s):
        good = 0
        for r in requests:
            times = r["token_times"]
            if not r["ok"] and not count_failed:
                continue
            ttft = times[0] - r["start"]
            if ttft > slo["ttft"]:
                continue
            if len(times) == 1 and one_token_fails:
                continue
            if (
                not ttft_only
                and len(times) > 1
                and ((times[-1] if to_last else r["end"]) - r["start"] - ttft) / (len(times) - 1)
                > slo["tpot"]
            ):
                continue
            good += 1
        return good / (len(requests) if per_request else duration_s)

    return goodput


def late_rule(offset=0, all_lateness=False, strict=True):
    def late_sends(trace, tolerance_s):
        late = [
            i + offset
            for i, (s, sent) in enumerate(trace)
            if (sent - s > tolerance_s if strict else sent - s >= tolerance_s)
        ]
        chosen = range(len(trace)) if all_lateness else [i - offset for i in late]
        return late, sum(trace[i][1] - trace[i][0] for i in chosen)

    return late_sends


def closed_loop(carry_backlog=True, from_send_is_schedule=False):
    def closed_loop_latencies(service_s, interval_s):
        from_send, from_schedule, previous_end = [], [], 0.0
        for k, service in enumerate(service_s):
            scheduled = k * interval_s
            sent = max(scheduled, previous_end) if carry_backlog else scheduled
            end = sent + service
            from_send.append(end - sent)
            from_schedule.append(end - (sent if from_send_is_schedule else scheduled))
            previous_end = end
        return from_send, from_schedule

    return closed_loop_latencies


def little(l_rule="gauge", lam_rule="departures", w_rule="whole", mutate=False):
    """An answer to Exercise 8 built from one way of getting L and one of getting lambda W."""

    def littles_law_window(gauge, requests, t0_s, t1_s):
        width = t1_s - t0_s
        if l_rule == "intervals":  # the requests' own presence: the identity, no gauge
            area = sum(max(0.0, min(b, t1_s) - max(a, t0_s)) for a, b in requests)
            L = area / width
        elif l_rule == "sample mean":  # counts samples instead of weighing them by time
            inside = [v for t, v in gauge if t0_s <= t <= t1_s]
            L = sum(inside) / len(inside) if inside else 0.0
        else:
            area = 0.0
            for k, (t, value) in enumerate(gauge):
                until = gauge[k + 1][0] if k + 1 < len(gauge) else math.inf
                if l_rule == "no carry-in" and t < t0_s:
                    continue
                if l_rule == "samples' span":
                    until = gauge[k + 1][0] if k + 1 < len(gauge) else t
                    area += value * (until - t)
                else:
                    area += value * max(0.0, min(until, t1_s) - max(t, t0_s))
            span = gauge[-1][0] - gauge[0][0] if l_rule == "samples' span" else width
            L = area / span if span > 0 else 0.0
        if lam_rule == "every request":
            chosen = list(requests)
        elif lam_rule == "arrivals":
            chosen = [(a, f) for a, f in requests if t0_s <= a <= t1_s]
        else:
            chosen = [(a, f) for a, f in requests if t0_s <= f <= t1_s]
        if w_rule == "clipped":
            stays = [f - max(a, t0_s) for a, f in chosen]
        else:
            stays = [f - a for a, f in chosen]
        if mutate:
            gauge.sort(key=lambda s: -s[1])
            requests.append((t0_s, t1_s))
        return L, sum(stays) / width

    return littles_law_window


def quantile_rule(interpolate=True, from_zero=False, cumulative=True, inf_value=None, strict=False):
    def quantile_from_buckets(q, buckets):
        if not cumulative:  # treats each count as the bucket's own
            running, rebuilt = 0.0, []
            for le, count in buckets:
                running += count
                rebuilt.append((le, running))
            buckets = rebuilt
        rank = q * buckets[-1][1]
        i = next(
            j
            for j, (_, count) in enumerate(buckets)
            if (count > rank if strict else count >= rank) or j == len(buckets) - 1
        )
        upper, count = buckets[i]
        if upper == math.inf:
            return inf_value if inf_value is not None else buckets[-2][0]
        if not interpolate:
            return float(upper)
        lower, below = buckets[i - 1] if i > 0 else (0.0, 0.0)
        if from_zero:
            lower, below = 0.0, 0.0
        if count == below:
            return lower
        return lower + (upper - lower) * (rank - below) / (count - below)

    return quantile_from_buckets


def rate_rule(on_drop):
    def counter_rate(samples):
        increase = 0.0
        for (_, a), (_, b) in zip(samples, samples[1:], strict=False):
            increase += b - a if b >= a else on_drop(a, b)
        return increase / (samples[-1][0] - samples[0][0])

    return counter_rate


def verdict(split, center=statistics.median, use_spread=True):
    def abba_verdict(values, order):
        a, b = split(values, order)
        ratio = center(b) / center(a)
        spread = max(a) / min(a) if use_spread else 1.0
        if ratio > spread:
            return "B better"
        if ratio < 1 / spread:
            return "B worse"
        return "no difference"

    return abba_verdict


def by_label(values, order):
    return (
        [v for v, x in zip(values, order, strict=True) if x == "A"],
        [v for v, x in zip(values, order, strict=True) if x == "B"],
    )


def share_ge(gaps, f):
    return sum(max(g) >= f for g in gaps) / len(gaps)


def stream_reader(
    count_empty=False,
    count_usage=False,
    tokens_from_chunks=False,
    stop_at_error=True,
    stop_at_done=True,
):
    def read_stream(events):
        times, num_tokens, error = [], None, None
        for arrival, line in events:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if stop_at_done:
                    break
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                if stop_at_error:
                    error = chunk["error"]["message"]
                    break
                continue
            choices = chunk.get("choices") or []
            if (choices and (choices[0].get("text") or count_empty)) or (
                count_usage and chunk.get("usage")
            ):
                times.append(arrival)
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
        if tokens_from_chunks:
            num_tokens = len(times)
        return {"token_times": times, "num_tokens": num_tokens, "error": error}

    return read_stream


def scheduler(sequential=False, all_at_once=False, zero_lags=False):
    async def send_on_schedule(starts_s, send):
        t0 = time.perf_counter()
        lags = [0.0] * len(starts_s)

        async def one(i):
            if not all_at_once:
                await asyncio.sleep(max(0.0, t0 + starts_s[i] - time.perf_counter()))
            if not zero_lags:
                lags[i] = time.perf_counter() - t0 - starts_s[i]
            await send(i)

        if sequential:
            for i in range(len(starts_s)):
                await one(i)
        else:
            await asyncio.gather(*(one(i) for i in range(len(starts_s))))
        return lags

    return send_on_schedule


def alternating(values, order):
    return values[0::2], values[1::2]


WRONG_ANSWERS = {
    "request_latencies": {
        "TTFT inside TPOT (E2EL / n)": latencies(lambda ttft, e2el, n: e2el / n),
        "n gaps instead of n - 1": latencies(lambda ttft, e2el, n: (e2el - ttft) / n),
        "to the last token, not the end": lambda s, t, e: {
            "ttft": t[0] - s,
            "e2el": e - s,
            "tpot": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
        },
        "one token gives 0, not None": latencies(
            lambda ttft, e2el, n: (e2el - ttft) / (n - 1) if n > 1 else 0.0
        ),
        "hard-coded worked example": lambda s, t, e: {"ttft": 0.5, "e2el": 1.2, "tpot": 0.7 / 3},
        "constant timing": lambda s, t, e: {"ttft": 0.1, "e2el": 0.1, "tpot": 0.1},
        "a tuple instead of a dict": lambda s, t, e: (
            t[0] - s,
            e - s,
            right_tpot(t[0] - s, e - s, len(t)),
        ),
        "changes its input": mutating_latencies,
    },
    "mean_itl_and_tpot": {
        "swapped": aggregate(per_request_tpot, pooled_itl),
        "ITL averaged per request": aggregate(per_request_itl, per_request_tpot),
        "TPOT with the first token": aggregate(pooled_itl, pooled_tpot_incl_first),
        "hard-coded worked example": lambda requests: (0.34, 0.25),
        "a list instead of a tuple": lambda requests: [
            pooled_itl(requests),
            per_request_tpot(requests),
        ],
    },
    "nearest_rank": {
        "numpy's linear interpolation": lambda values, p: float(
            __import__("numpy").percentile(values, p)
        ),
        "index int(p / 100 * N)": rank_rule(lambda p, n: min(n - 1, int(p / 100 * n))),
        "rank ceil(p / 100 * N)": rank_rule(lambda p, n: max(1, math.ceil(p / 100 * n)) - 1),
        "unsorted": lambda values, p: values[max(1, math.ceil(p * len(values) / 100)) - 1],
        "sorts the caller's list": in_place_rank,
        "hard-coded worked example": lambda values, p: 0.3,
    },
    "freeze_report": {
        "share over gaps": freeze(share_gaps, p99_pooled, p99_worst),
        "p99 of per-stream mean gaps": freeze(share_streams, p99_pooled, p99_mean_gap),
        "worst gaps for both": freeze(share_streams, p99_worst, p99_worst),
        "hard-coded worked example": lambda streams, f: (0.03, 0.02, 2.02),
        ">= for exceeds": freeze(lambda gaps, f: share_ge(gaps, f), p99_pooled, p99_worst),
        "a list instead of a tuple": lambda streams, f: list(
            freeze(share_streams, p99_pooled, p99_worst)(streams, f)
        ),
    },
    "goodput": {
        "failed requests counted": goodput_rule(count_failed=True),
        "one-token requests fail TPOT": goodput_rule(one_token_fails=True),
        "a share of requests": goodput_rule(per_request=True),
        "TTFT only": goodput_rule(ttft_only=True),
        "TPOT to the last token, not the end": goodput_rule(to_last=True),
        "hard-coded worked example": lambda requests, slo, duration_s: 1.0,
        "an int": lambda requests, slo, duration_s: int(goodput_rule()(requests, slo, duration_s)),
    },
    "late_sends": {
        "indices from 1": late_rule(offset=1),
        "every request's lateness": late_rule(all_lateness=True),
        "hard-coded worked example": lambda trace, tol: ([2, 3], 2.1),
        "a list instead of a tuple": lambda trace, tol: list(late_rule()(trace, tol)),
    },
    "closed_loop_latencies": {
        "latency from the send for both": closed_loop(from_send_is_schedule=True),
        "no backlog (sent on schedule)": closed_loop(carry_backlog=False),
        "hard-coded worked example": lambda service, interval: (
            list(service),
            [0.1, 0.1, 2.0, 1.6, 1.2, 0.8],
        ),
        "constant timing": lambda service, interval: ([0.1] * len(service), [0.1] * len(service)),
    },
    "littles_law_window": {
        "L from the requests' intervals (the identity)": little(l_rule="intervals"),
        "mean of the samples, not a time average": little(l_rule="sample mean"),
        "the value before the window not carried in": little(l_rule="no carry-in"),
        "averaged over the samples' span, not the window": little(l_rule="samples' span"),
        "lambda W over every request": little(lam_rule="every request"),
        "lambda from arrivals in the window": little(lam_rule="arrivals"),
        "W clipped to the window": little(w_rule="clipped"),
        "changes the caller's lists": little(mutate=True),
        "hard-coded worked example": lambda gauge, requests, t0, t1: (2.0, 1.85),
        "a list instead of a tuple": lambda gauge, requests, t0, t1: list(
            little()(gauge, requests, t0, t1)
        ),
    },
    "quantile_from_buckets": {
        "no interpolation": quantile_rule(interpolate=False),
        "interpolated from 0": quantile_rule(from_zero=True),
        "counts read as per bucket": quantile_rule(cumulative=False),
        "+Inf returned": quantile_rule(inf_value=math.inf),
        "first bucket with count > rank": quantile_rule(strict=True),
        "hard-coded worked example": lambda q, buckets: 0.4 if q == 0.5 else 1.0,
    },
    "read_stream": {
        "empty chunks counted": stream_reader(count_empty=True),
        "usage chunk counted": stream_reader(count_usage=True),
        "tokens = chunks": stream_reader(tokens_from_chunks=True),
        "error event ignored": stream_reader(stop_at_error=False),
        "reads past [DONE]": stream_reader(stop_at_done=False),
        "hard-coded worked example": lambda events: {
            "token_times": [0.5, 0.7, 0.9],
            "num_tokens": 12,
            "error": None,
        },
        "a tuple instead of a dict": lambda events: tuple(stream_reader()(events).values()),
    },
    "send_on_schedule": {
        "waits for each request (closed loop)": scheduler(sequential=True),
        "everything at once": scheduler(all_at_once=True),
        "lags all zero": scheduler(zero_lags=True),
    },
    "counter_rate": {
        "a drop as a negative increase": rate_rule(lambda a, b: b - a),
        "a drop adds nothing": rate_rule(lambda a, b: 0.0),
        "hard-coded worked example": lambda samples: 110 / 45,
        "an int": lambda samples: round(rate_rule(lambda a, b: b)(samples)),
    },
    "abba_verdict": {
        "no A/A spread": verdict(by_label, use_spread=False),
        "alternating labels": verdict(alternating),
        "means instead of medians": verdict(by_label, center=statistics.fmean),
        "constant": lambda values, order: "no difference",
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch09_metrics.ipynb"
    EXERCISE = ROOT / "exercises" / "ch09_metrics.ipynb"
    POINTS = [1, 1, 1, 1, 1, 1, 3, 2, 4, 1, 1, 6, 5]
    WRONG_ANSWERS = WRONG_ANSWERS
