"""Batch slots over time: which request holds each of the `max_num_seqs` seats at every step.

A request takes a seat when the scheduler first gives it tokens and keeps it until the step
that samples its last token (or until it is preempted). Static batching leaves a seat empty
from the moment its request finishes until the whole batch is done; continuous batching hands
it to a waiting request in the next step. Counting the empty seat-steps (idle slot-steps)
while requests are still waiting measures exactly that waste.
"""

from __future__ import annotations

from collections.abc import Sequence

from minillm.core.metrics import StepTrace

SlotTimeline = list[list[str | None]]  # [step][seat] -> request id, or None when empty


def seat_intervals(traces: Sequence[StepTrace]) -> list[tuple[str, int, int]]:
    """(request id, first step, last step) of every stay in the batch, in order of arrival.

    A stay starts at the first step that schedules the request and ends at the last step that
    schedules it before it finishes or is preempted (a preempted request starts a new stay when
    it is scheduled again).
    """
    open_stays: dict[str, list] = {}  # request id -> [id, first step, last step]
    stays: list[list] = []
    for trace in traces:
        for request_id, _, _ in trace.scheduled:
            if request_id not in open_stays:
                open_stays[request_id] = [request_id, trace.step, trace.step]
                stays.append(open_stays[request_id])
            open_stays[request_id][2] = trace.step
        for request_id in trace.preempted:
            open_stays.pop(request_id, None)
    return [(request_id, first, last) for request_id, first, last in stays]


def slot_timeline(traces: Sequence[StepTrace], max_num_seqs: int) -> SlotTimeline:
    """The seat each request occupies at each step: a stay takes the lowest free seat."""
    if not traces:
        return []
    first_step = traces[0].step
    timeline: SlotTimeline = [[None] * max_num_seqs for _ in traces]
    seat_free_from = [first_step] * max_num_seqs  # the first step at which each seat is free
    for request_id, first, last in seat_intervals(traces):
        free = [seat for seat in range(max_num_seqs) if seat_free_from[seat] <= first]
        if not free:
            raise ValueError(f"more than max_num_seqs={max_num_seqs} requests at step {first}")
        seat = free[0]
        for step in range(first, last + 1):
            timeline[step - first_step][seat] = request_id
        seat_free_from[seat] = last + 1
    return timeline


def idle_slot_steps(
    traces: Sequence[StepTrace], max_num_seqs: int, while_waiting: bool = False
) -> int:
    """Seat-steps with no request in them. With while_waiting, only steps after which requests
    were still waiting count: the seats a better schedule could have filled."""
    timeline = slot_timeline(traces, max_num_seqs)
    return sum(
        row.count(None)
        for row, trace in zip(timeline, traces, strict=True)
        if not while_waiting or trace.num_waiting > 0
    )


def static_batching_idle_slot_steps(num_output_tokens: Sequence[int], batch_size: int) -> int:
    """Idle slot-steps of static batching when every prompt is prefilled in one step.

    Requests are grouped in arrival order, batch_size at a time. A batch runs for as many steps
    as its longest request has output tokens (the prefill step samples the first one), and each
    of its batch_size seats is busy only for its own request's tokens:

        idle = sum over batches of (batch_size * max(batch) - sum(batch))
    """
    idle = 0
    for start in range(0, len(num_output_tokens), batch_size):
        batch = num_output_tokens[start : start + batch_size]
        idle += batch_size * max(batch) - sum(batch)
    return idle
