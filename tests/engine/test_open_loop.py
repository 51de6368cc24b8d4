"""Open-loop runs on a tiny random Llama: every request is served with its arrival time, the
gauges are sampled, and Little's law holds between them."""

from __future__ import annotations

import pytest
from tiny_llama import build_tiny_llama

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.open_loop import (
    TimedRequest,
    poisson_arrival_times,
    run_open_loop,
    time_average,
)
from minillm.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return LLMEngine(EngineArgs(model=model_dir, device="cpu", max_model_len=64, max_num_seqs=2))


def test_time_average_holds_each_sample_until_the_next():
    assert time_average([(1.0, 4), (3.0, 1)], 4.0) == pytest.approx((2 * 4 + 1 * 1) / 4)
    assert time_average([], 2.0) == 0.0
    assert time_average([(0.0, 2), (5.0, 9)], 4.0) == pytest.approx(2.0)


def test_poisson_arrivals_are_seeded_and_have_the_right_rate():
    times = poisson_arrival_times(50.0, 4000, seed=3)
    assert times == poisson_arrival_times(50.0, 4000, seed=3)
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(1 / 50.0, rel=0.05)
    with pytest.raises(ValueError, match="positive"):
        poisson_arrival_times(0.0, 3)


def test_every_request_is_served_with_its_arrival_time(engine):
    requests = [TimedRequest(0.02 * i, [5 + i, 6, 7], PARAMS) for i in range(6)]
    run = run_open_loop(engine, requests)
    assert len(run.metrics) == 6
    for request, metrics, queued in zip(requests, run.metrics, run.queued_times, strict=True):
        assert metrics.arrival_time == pytest.approx(run.start_time + request.arrival_s)
        assert queued >= metrics.arrival_time
        assert metrics.first_scheduled_time >= queued
        assert metrics.num_output_tokens == PARAMS.max_tokens
    assert run.gauge and all(s.num_running <= 2 for s in run.gauge)
    assert not engine.has_unfinished_requests()


def test_littles_law_holds_for_the_waiting_gauge_under_load(engine):
    # a burst much larger than two seats: a long queue that drains step by step
    requests = [TimedRequest(0.0005 * i, [5 + i % 40, 6, 7, 8], PARAMS) for i in range(40)]
    run = run_open_loop(engine, requests)
    littles = run.arrival_rate_per_s * run.mean_engine_queueing_time_s
    assert run.mean_num_waiting == pytest.approx(littles, rel=0.05)
    assert run.mean_queueing_time_s >= run.mean_engine_queueing_time_s


def test_each_gauge_sample_is_the_queue_while_its_step_runs(engine):
    # The waiting queue, rebuilt from each request's entry and first schedule, against the
    # gauge in the middle of each sample's interval: the step the sample describes.
    requests = [TimedRequest(0.0005 * i, [5 + i % 40, 6, 7, 8], PARAMS) for i in range(40)]
    run = run_open_loop(engine, requests)
    bounds = [run.start_time + sample.time_s for sample in run.gauge] + [run.end_time]
    for k, sample in enumerate(run.gauge):
        mid = (bounds[k] + bounds[k + 1]) / 2
        waiting = sum(
            queued <= mid < metrics.first_scheduled_time
            for metrics, queued in zip(run.metrics, run.queued_times, strict=True)
        )
        assert sample.num_waiting == waiting, f"step {k}"


def test_littles_law_holds_for_the_waiting_gauge_under_poisson_arrivals(engine):
    # The gauge's samples and the queueing times come from the same step boundaries, so
    # L = λW holds up to the instants between steps, whatever the machine's speed.
    arrivals = poisson_arrival_times(400.0, 40, seed=3)
    requests = [TimedRequest(t, [5 + i % 40, 6, 7, 8], PARAMS) for i, t in enumerate(arrivals)]
    run = run_open_loop(engine, requests)
    littles = run.arrival_rate_per_s * run.mean_engine_queueing_time_s
    assert littles > 0
    assert run.mean_num_waiting == pytest.approx(littles, rel=0.05, abs=0.01)


def test_a_busy_engine_is_refused(engine):
    engine.add_request("busy", [5, 6], PARAMS)
    with pytest.raises(ValueError, match="idle"):
        run_open_loop(engine, [TimedRequest(0.0, [5], PARAMS)])
    while engine.has_unfinished_requests():
        engine.step()
