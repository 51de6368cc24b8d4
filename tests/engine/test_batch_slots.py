"""Seat timelines from step traces, against hand-drawn cases and the closed form for static
batching on simulated schedules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.core.metrics import StepTrace
from minillm.lab.batch_slots import (
    idle_slot_steps,
    seat_intervals,
    slot_timeline,
    static_batching_idle_slot_steps,
)
from minillm.lab.schedule_sim import simulate_schedule


def test_continuous_batching_refills_a_seat_in_the_next_step():
    # two seats; a has 1 output token, b 3, c 2
    sim = simulate_schedule([(2, 1), (2, 3), (2, 2)], max_num_seqs=2)
    assert slot_timeline(sim.traces, 2) == [["0", "1"], ["2", "1"], ["2", "1"]]
    assert idle_slot_steps(sim.traces, 2) == 0


def test_static_batching_leaves_the_seat_empty_until_the_batch_ends():
    sim = simulate_schedule([(2, 1), (2, 3), (2, 2)], max_num_seqs=2, batching_type="static")
    assert slot_timeline(sim.traces, 2) == [
        ["0", "1"],
        [None, "1"],
        [None, "1"],
        ["2", None],
        ["2", None],
    ]
    assert idle_slot_steps(sim.traces, 2) == 4
    # while c waits (steps 0-2) a's seat is empty twice
    assert idle_slot_steps(sim.traces, 2, while_waiting=True) == 2


def test_a_preempted_request_gets_a_new_stay():
    traces = [
        StepTrace(0, [("a", 4, "prefill"), ("b", 4, "prefill")], []),
        StepTrace(1, [("a", 1, "decode")], ["b"]),
        StepTrace(2, [("a", 1, "decode")], []),
        StepTrace(3, [("b", 5, "prefill")], []),
    ]
    assert seat_intervals(traces) == [("a", 0, 2), ("b", 0, 0), ("b", 3, 3)]
    assert slot_timeline(traces, 2) == [["a", "b"], ["a", None], ["a", None], ["b", None]]


def test_too_many_requests_for_the_seats_is_an_error():
    traces = [StepTrace(0, [("a", 1, "prefill"), ("b", 1, "prefill")], [])]
    with pytest.raises(ValueError, match="max_num_seqs=1"):
        slot_timeline(traces, 1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=10), st.integers(1, 4))
def test_static_idle_slot_steps_match_the_simulated_schedule(num_output_tokens, batch_size):
    requests = [(3, n) for n in num_output_tokens]
    sim = simulate_schedule(requests, max_num_seqs=batch_size, batching_type="static")
    expected = static_batching_idle_slot_steps(num_output_tokens, batch_size)
    assert idle_slot_steps(sim.traces, batch_size) == expected
    # and continuous batching never leaves a seat empty while a request waits
    sim = simulate_schedule(requests, max_num_seqs=batch_size)
    assert idle_slot_steps(sim.traces, batch_size, while_waiting=True) == 0
