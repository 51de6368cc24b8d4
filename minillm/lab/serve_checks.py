"""Checks of a live server's own numbers against each other and against its clients'.

Two instruments for any server that exposes vLLM's Prometheus metrics (`minillm serve`,
vLLM itself):

- `percentile_agreement`: the client's TTFT (or E2EL) percentiles against the quantiles
  `histogram_quantile` reads from the server's histogram over the same run. A histogram
  only knows which bucket a value fell in, so the two agree when they differ by less than
  the width of the bucket holding the server's estimate. The client's value is a little
  larger by nature (it includes the HTTP round trip and the SSE parsing).
- `littles_law`: L = λW on the server alone. L is the time average of the gauges
  `num_requests_running + num_requests_waiting`, sampled while the load runs; λ is the rate
  at which requests finished (the `request_success` counter), and W their mean time in the
  server (the E2E histogram's sum over its count). In a steady state the two sides match;
  the ratio says how far the run was from one (ramp-up, ramp-down, a short window), and
  one more thing: W counts from a request's arrival at the engine's door, the gauges only
  from when the engine thread has put it in the scheduler's queue (between two steps, as in
  vLLM), so a busy engine thread shows as L below λW.

    before = scrape(url)
    with InSystemSampler(url) as sampler:
        result = loadgen.run(target, sessions, concurrency=4)
    after = scrape(url)
    percentile_agreement([r.ttft for r in ...], histogram_delta(before, after, TTFT))
    littles_law(before, after, sampler.samples)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from minillm.lab import serving_metrics as sm

TTFT = "vllm:time_to_first_token_seconds"
E2EL = "vllm:e2e_request_latency_seconds"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
SUCCESS = "vllm:request_success_total"

# a scrape: every sample, as {(name, ((label, value), ...)): value}
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Scrape:
    """Prometheus text format -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def scrape(base_url: str, api_key: str | None = None, transport=None) -> Scrape:
    """GET /metrics from a server and parse it."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url.rstrip("/"), transport=transport, timeout=30) as client:
        response = client.get("/metrics", headers=headers)
    response.raise_for_status()
    return parse_metrics(response.text)


def total(samples: Scrape, name: str) -> float:
    """A sample summed over all its label sets (every model, every finished_reason)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def histogram_buckets(samples: Scrape, name: str) -> list[tuple[float, float]]:
    """The histogram `name` as (le, cumulative count) pairs, summed over its label sets."""
    counts: dict[float, float] = {}
    for (n, labels), value in samples.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            counts[le] = counts.get(le, 0.0) + value
    if not counts:
        raise ValueError(f"the scrape has no histogram {name!r}")
    return sorted(counts.items())


def histogram_delta(before: Scrape, after: Scrape, name: str) -> list[tuple[float, float]]:
    """What the histogram counted between two scrapes (the run's own observations)."""
    has_before = any(n == f"{name}_bucket" for n, _ in before)
    old = dict(histogram_buckets(before, name)) if has_before else {}
    return [(le, count - old.get(le, 0.0)) for le, count in histogram_buckets(after, name)]


def bucket_of(buckets: Sequence[tuple[float, float]], value: float) -> tuple[float, float]:
    """(lower, upper) bounds of the bucket a value falls in (lower 0 for the first)."""
    lower = 0.0
    for le, _ in buckets:
        if value <= le:
            return lower, le
        lower = le
    return lower, math.inf


@dataclass(frozen=True, slots=True)
class Agreement:
    percentile: float
    client_s: float  # nearest-rank percentile of the client's values
    server_s: float  # histogram_quantile of the server's histogram
    bucket_s: tuple[float, float]  # the bucket holding server_s
    agree: bool  # |client - server| <= the bucket's width


def percentile_agreement(
    client_values_s: Sequence[float],
    buckets: Sequence[tuple[float, float]],
    percentiles: Sequence[float] = (50, 90, 99),
) -> list[Agreement]:
    """Compare a client's percentiles with the server histogram's quantiles (see the module
    docstring). The histogram must count the same requests: take `histogram_delta` of
    scrapes before and after the run."""
    if not client_values_s:
        raise ValueError("no client values")
    out = []
    for p in percentiles:
        client = sm.percentile(client_values_s, p)
        server = sm.histogram_quantile(p / 100, buckets)
        lower, upper = bucket_of(buckets, server)
        width = upper - lower
        agree = abs(client - server) <= width
        out.append(Agreement(p, client, server, (lower, upper), agree))
    return out


@dataclass
class InSystemSampler:
    """Polls a server's running and waiting gauges in a thread: (time, running + waiting)."""

    base_url: str
    period_s: float = 0.05
    api_key: str | None = None
    samples: list[tuple[float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            s = scrape(self.base_url, self.api_key)
            self.samples.append((time.perf_counter(), total(s, RUNNING) + total(s, WAITING)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> InSystemSampler:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def time_average(samples: Sequence[tuple[float, float]]) -> float:
    """The time average of a step function sampled at (t, value): each value holds until
    the next sample."""
    if len(samples) < 2:
        raise ValueError("a time average needs at least two samples")
    area = sum(v * (t1 - t0) for (t0, v), (t1, _) in zip(samples, samples[1:], strict=False))
    return area / (samples[-1][0] - samples[0][0])


def littles_law(before: Scrape, after: Scrape, in_system: Sequence[tuple[float, float]]) -> dict:
    """L measured (the gauges' time average over the sampling window) beside λW (requests
    finished per second of the window times their mean E2E latency, from the counters).

    The window is the sampler's, from its first to its last sample; start it before the
    load and stop it after the last response, so that every request counted lies inside."""
    window_s = in_system[-1][0] - in_system[0][0]
    finished = total(after, SUCCESS) - total(before, SUCCESS)
    latency_sum = total(after, f"{E2EL}_sum") - total(before, f"{E2EL}_sum")
    latency_count = total(after, f"{E2EL}_count") - total(before, f"{E2EL}_count")
    if latency_count == 0:
        raise ValueError("no request finished between the scrapes")
    arrival_rate = finished / window_s
    mean_latency_s = latency_sum / latency_count
    measured = time_average(in_system)
    predicted = arrival_rate * mean_latency_s
    return {
        "window_s": window_s,
        "finished": finished,
        "lambda_rps": arrival_rate,
        "w_s": mean_latency_s,
        "l_lambda_w": predicted,
        "l_measured": measured,
        "ratio": measured / predicted if predicted else math.nan,
    }


def check_server(
    base_url: str,
    model: str | None = None,
    *,
    num_requests: int = 16,
    concurrency: int = 4,
    input_len: int = 32,
    output_len: int = 16,
    seed: int = 0,
    tokenizer=None,
    api_key: str | None = None,
) -> dict:
    """Run a closed-loop load on a live server while sampling its gauges; return both
    checks: the client's TTFT and E2EL percentiles against the server's histograms, and
    Little's law on the server."""
    from dataclasses import asdict

    from minillm.lab import loadgen

    model = model or loadgen.server_model(base_url, api_key)
    target = loadgen.Target(base_url, model, api_key=api_key)
    sessions = loadgen.fixed_sessions(num_requests, input_len, output_len, seed, tokenizer)
    before = scrape(base_url, api_key)
    with InSystemSampler(base_url, api_key=api_key) as sampler:
        run = loadgen.run(target, sessions, concurrency=concurrency, seed=seed)
    after = scrape(base_url, api_key)
    done = [r for r in run.records if r.ok]
    ttfts = [r.token_times_s[0] - r.sent_s for r in done]
    e2els = [r.end_s - r.sent_s for r in done]
    return {
        "load": {
            "mode": "closed",
            "concurrency": concurrency,
            "requests": num_requests,
            "input_len": input_len,
            "output_len": output_len,
        },  # fmt: skip
        "completed": len(done),
        "ttft": [
            asdict(a) for a in percentile_agreement(ttfts, histogram_delta(before, after, TTFT))
        ],
        "e2el": [
            asdict(a) for a in percentile_agreement(e2els, histogram_delta(before, after, E2EL))
        ],
        "littles_law": littles_law(before, after, sampler.samples),
        # L as the client sees it: requests between their send and their last byte
        "l_client": sm.mean_in_flight(
            [(r.sent_s, r.end_s) for r in done], 0.0, max(r.end_s for r in done)
        ),
    }


def main(argv: list[str] | None = None) -> int:
    """python -m minillm.lab.serve_checks --base-url URL [--json FILE]"""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--model", default=None, help="the served name (default: the server's)")
    p.add_argument("--api-key", default=None, help="for a server started with --api-key")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = check_server(
        args.base_url,
        args.model,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        api_key=args.api_key,
    )
    for name in ("ttft", "e2el"):
        for a in result[name]:
            print(
                f"{name} p{a['percentile']:g}: client {a['client_s'] * 1e3:.1f} ms, server "
                f"{a['server_s'] * 1e3:.1f} ms, bucket {a['bucket_s']}, agree {a['agree']}"
            )
    print(
        "(the client's times also hold HTTP, JSON and tokenizing, which the server's histograms "
        "start after: on a loaded machine the client's can sit a bucket above)"
    )
    law = result["littles_law"]
    print(
        f"Little's law: L from the gauges {law['l_measured']:.2f}, lambda W from the counters "
        f"{law['l_lambda_w']:.2f}, L in flight at the client {result['l_client']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
