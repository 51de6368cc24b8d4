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
