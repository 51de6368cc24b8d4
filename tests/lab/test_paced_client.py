"""The paced client against its timing rules on a real engine. Timings are never asserted as
speeds: only orders, equalities the rules imply, and counts."""

from __future__ import annotations

import pytest

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lab import serving_metrics as sm
from minillm.lab.open_loop import TimedRequest
from minillm.lab.paced_client import run_paced
from minillm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineArgs(device="cpu", max_model_len=128, max_num_seqs=4))


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def in_flight_at(timings, t: float) -> int:
    return sum(r.sent_s <= t < r.end_s for r in timings)


def test_closed_loop_keeps_at_most_c_in_flight(engine):
    timings = run_paced(engine, [TimedRequest(0.0, "def f(x):", params(4)) for _ in range(6)], 2)
    assert [len(r.token_times_s) for r in timings] == [4] * 6
    assert all(in_flight_at(timings, r.sent_s) <= 2 for r in timings)
    assert timings[0].sent_s == timings[1].sent_s == 0.0
    ends = {r.end_s for r in timings}
    # every later request was sent the moment an earlier one ended, never on its schedule (0)
    assert all(r.sent_s in ends for r in timings[2:])
    for r in timings:
        assert r.scheduled_s <= r.sent_s <= r.token_times_s[0] <= r.token_times_s[-1] <= r.end_s
    assert not engine.has_unfinished_requests()


def test_one_connection_sends_each_request_when_the_last_ends(engine):
    lengths = [3, 24, 3, 3]  # the second request holds the connection for a while
    requests = [TimedRequest(0.02 * k, "def f(x):", params(n)) for k, n in enumerate(lengths)]
    timings = run_paced(engine, requests, max_in_flight=1)
    for k in range(1, len(timings)):
        assert timings[k].sent_s == max(timings[k].scheduled_s, timings[k - 1].end_s)
    late = sm.late_sends(timings, 0.0)
    assert 2 in late and 3 in late  # both waited behind the long request
    for r in timings:
        assert sm.ttft_s(r.scheduled_s, r.token_times_s) >= sm.ttft_s(r.sent_s, r.token_times_s)


def test_without_a_cap_every_request_is_sent_on_schedule(engine):
    requests = [TimedRequest(0.01 * k, "def f(x):", params(3)) for k in range(5)]
    timings = run_paced(engine, requests)
    assert [r.sent_s for r in timings] == [r.arrival_s for r in requests]
    assert sm.late_sends(timings, 0.0) == []


def test_results_come_back_in_the_order_given(engine):
    requests = [TimedRequest(0.03, "a", params(2)), TimedRequest(0.0, "b", params(5))]
    timings = run_paced(engine, requests)
    assert [r.scheduled_s for r in timings] == [0.03, 0.0]
    assert [len(r.token_times_s) for r in timings] == [2, 5]


@pytest.mark.parametrize("cap", [0, -1, True, 1.5])
def test_a_bad_cap_is_rejected(engine, cap):
    with pytest.raises(ValueError, match="max_in_flight"):
        run_paced(engine, [TimedRequest(0.0, "a", params(1))], cap)


def test_a_busy_engine_is_rejected(engine):
    engine.add_request("busy", "a", params(2))
    try:
        with pytest.raises(ValueError, match="idle"):
            run_paced(engine, [TimedRequest(0.0, "a", params(1))])
    finally:
        while engine.has_unfinished_requests():
            engine.step()
