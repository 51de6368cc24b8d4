"""A client with a schedule and a cap on requests in flight, played in-process into an engine.

`run_paced` is the load generator's timing model (`minillm.lab.loadgen`) without HTTP: each
request has a scheduled time, and it is *sent* (added to the engine, stamped with that time
as its arrival) at the later of its schedule and the moment the client has a free slot.

- `max_in_flight=None`: nothing holds a request back, so it is sent on schedule: open loop.
- all scheduled at 0 and `max_in_flight=C`: C users that each send their next request when
  the last one ends: a closed loop at concurrency C.
- a timetable and `max_in_flight=1`: a client with one connection that means to send on
  schedule but waits for each answer first, the client that suffers coordinated omission.

The engine measures from the send, as a server does; the client keeps both times, so the
latency it hides (the wait from schedule to send) can be counted. A step is not interrupted:
a request due during a step reaches the engine when the step ends, and its send time is still
the time it was due (or the time its slot freed), as for a real client whose request waits in
the server's front end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from minillm.engine.llm_engine import LLMEngine
from minillm.lab.open_loop import TimedRequest
from minillm.lab.serving_metrics import RequestTiming


def run_paced(
    engine: LLMEngine, requests: Sequence[TimedRequest], max_in_flight: int | None = None
) -> list[RequestTiming]:
    """Serve `requests` in real time, each sent at max(its schedule, a free slot); returns one
    `RequestTiming` per request (in the order given), times in seconds since the run's start.

    Requests are sent in order of their schedule. The engine must be idle and use a real clock.
    """
    if max_in_flight is not None and (
        not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1
    ):
        raise ValueError(f"max_in_flight must be a positive int or None, got {max_in_flight!r}")
    if engine.has_unfinished_requests():
        raise ValueError("the engine must be idle at the start of a paced run")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    start = engine.clock()
    sent = [0.0] * len(requests)
    metrics: dict[int, object] = {}
    in_flight: dict[str, int] = {}  # request id -> index
    free_since = 0.0  # since when the client has had a free slot (run clock)
    next_index = 0
    while next_index < len(order) or in_flight:
        now = engine.clock() - start
        while next_index < len(order) and (max_in_flight is None or len(in_flight) < max_in_flight):
            i = order[next_index]
            due = requests[i].arrival_s
            if due > now:
                break
            sent[i] = max(due, free_since)
            request_id = f"paced-{i}"
            engine.add_request(
                request_id,
                requests[i].prompt,
                requests[i].params,
                arrival_time=start + sent[i],
                priority=requests[i].priority,
            )
            metrics[i] = engine.output_processor.states[request_id].seqs[0].metrics
            in_flight[request_id] = i
            next_index += 1
        if not in_flight:
            time.sleep(max(0.0, start + requests[order[next_index]].arrival_s - engine.clock()))
            continue
        for output in engine.step():
            if output.finished and output.request_id in in_flight:
                was_full = max_in_flight is not None and len(in_flight) >= max_in_flight
                i = in_flight.pop(output.request_id)
                if was_full:  # the slot this request held is free from its end on
                    free_since = metrics[i].finished_time - start
    return [
        RequestTiming(
            scheduled_s=requests[i].arrival_s,
            sent_s=sent[i],
            token_times_s=tuple(t - start for t in metrics[i].token_times),
            end_s=metrics[i].finished_time - start,
        )
        for i in range(len(requests))
    ]


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
        (float("inf"), float(len(values)))
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
