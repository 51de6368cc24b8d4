"""Latency metrics against hand-computed values from injected timestamps."""

import pytest

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.metrics import RequestMetrics, mean_itl_s, mean_tpot_s
from minillm.core.request import Request
from minillm.core.scheduler import Scheduler
from minillm.engine.metrics import EngineStats
from minillm.outputs import SampledToken
from minillm.sampling_params import SamplingParams


def metrics(arrival, scheduled, token_times, finished):
    m = RequestMetrics(arrival_time=arrival)
    m.record_scheduled(scheduled)
    for t in token_times:
        m.record_token(t)
    m.record_finished(finished)
    return m


# a: 3 tokens with uneven gaps; b: 5 tokens 0.2 s apart
A = dict(arrival=0.0, scheduled=0.5, token_times=[1.0, 1.5, 2.5], finished=2.5)
B = dict(arrival=1.0, scheduled=1.0, token_times=[2.0, 2.2, 2.4, 2.6, 2.8], finished=2.8)


def test_single_request_latencies():
    a = metrics(**A)
    assert a.queueing_time_s == 0.5
    assert a.ttft_s == 1.0
    assert a.itl_s == [0.5, 1.0]
    assert a.e2el_s == 2.5
    assert a.tpot_s == pytest.approx(0.75)  # (2.5 - 1.0) / (3 - 1)
    assert a.mean_itl_s == pytest.approx(0.75)  # one request: both conventions agree
    assert a.first_token_time == 1.0
    assert a.num_output_tokens == 3


def test_tpot_conventions_differ_across_requests():
    a, b = metrics(**A), metrics(**B)
    assert b.tpot_s == pytest.approx(0.2)
    # per request: (0.75 + 0.2) / 2; per token: (0.5 + 1.0 + 4 * 0.2) / 6 gaps
    assert mean_tpot_s([a, b]) == pytest.approx(0.475)
    assert mean_itl_s([a, b]) == pytest.approx(2.3 / 6)


def test_undefined_latencies_are_none():
    m = RequestMetrics(arrival_time=3.0)
    assert (m.queueing_time_s, m.ttft_s, m.e2el_s, m.tpot_s, m.mean_itl_s) == (None,) * 5
    assert m.itl_s == []
    m.record_token(4.0)
    m.record_finished(4.0)
    assert (m.ttft_s, m.e2el_s, m.tpot_s) == (1.0, 1.0, None)  # one token: no gap, no TPOT
    assert mean_tpot_s([m]) is None and mean_itl_s([m]) is None


def test_first_scheduled_time_survives_preemption():
    m = RequestMetrics(arrival_time=0.0)
    m.record_scheduled(1.0)
    m.record_scheduled(5.0)
    assert m.queueing_time_s == 1.0


def test_scheduler_stamps_requests_with_its_clock():
    ticks = iter(range(10, 100))
    manager = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(manager, 4, 4, 64, clock=lambda: float(next(ticks)))
    request = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2), arrival_time=2.0)
    scheduler.add_request(request)
    for _ in range(3):  # chunks of 4 and 2 prompt tokens, then one decode
        output = scheduler.schedule()
        samples = {s.request.request_id: SampledToken(9) for s in output.scheduled if s.samples}
        scheduler.update_from_output(output, samples)
    # clock reads: schedule 10 (admission), update 11, update 12 (token 1), update 13 (token 2)
    m = request.metrics
    assert m.first_scheduled_time == 10.0
    assert m.token_times == [12.0, 13.0]
    assert m.finished_time == 13.0
    assert (m.queueing_time_s, m.ttft_s, m.e2el_s, m.tpot_s) == (8.0, 10.0, 11.0, 1.0)


def test_engine_stats_prefix_cache_hit_rate():
    stats = EngineStats()
    assert stats.prefix_cache_hit_rate == 0.0
    stats.prefix_cache_queries, stats.prefix_cache_hits = 40, 30
    assert stats.prefix_cache_hit_rate == 0.75


def test_a_request_with_several_completions_is_described_whole():
    from minillm.core.metrics import merge_request_metrics

    a = RequestMetrics(arrival_time=1.0, first_scheduled_time=2.0, token_times=[3.0, 4.0])
    a.finished_time = 4.0
    b = RequestMetrics(arrival_time=1.0, first_scheduled_time=2.0, token_times=[3.0, 4.0, 6.0])
    b.finished_time = 6.0
    whole = merge_request_metrics([a, b])
    assert whole.ttft_s == 2.0  # the first token of any completion
    assert whole.e2el_s == 5.0  # until the last completion finishes
    assert whole.token_times == [3.0, 4.0, 6.0]  # one per step that produced output
    assert whole.tpot_s == (5.0 - 2.0) / 2
    assert merge_request_metrics([a]) is a
    running = RequestMetrics(arrival_time=1.0, token_times=[3.0])
    assert merge_request_metrics([a, running]).finished_time is None
