"""The server checks: on histograms and gauges built by hand, then on a live server."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from minillm import LLM
from minillm.lab import loadgen
from minillm.lab import serve_checks as sc


def exposition(ttfts: list[float], e2els: list[float], finished: int) -> str:
    registry = CollectorRegistry()
    ttft = Histogram(sc.TTFT, "", buckets=(0.1, 0.2, 0.4), registry=registry, labelnames=["m"])
    e2e = Histogram(sc.E2EL, "", buckets=(1.0, 2.0), registry=registry, labelnames=["m"])
    success = Counter("vllm:request_success", "", ["m", "finished_reason"], registry=registry)
    for v in ttfts:
        ttft.labels("a").observe(v)
    for v in e2els:
        e2e.labels("a").observe(v)
    success.labels("a", "length").inc(finished - 1)
    success.labels("a", "stop").inc(1)
    return generate_latest(registry).decode()


def test_buckets_are_read_cumulative_and_differenced_between_scrapes():
    before = sc.parse_metrics(exposition([0.05, 0.3], [1.5], 1))
    after = sc.parse_metrics(exposition([0.05, 0.3, 0.15, 0.15, 0.5], [1.5, 0.5], 2))
    assert sc.histogram_buckets(after, sc.TTFT) == [(0.1, 1), (0.2, 3), (0.4, 4), (math.inf, 5)]
    # the run's own: two at 0.15 and one at 0.5
    assert sc.histogram_delta(before, after, sc.TTFT) == [
        (0.1, 0),
        (0.2, 2),
        (0.4, 2),
        (math.inf, 3),
    ]
    with pytest.raises(ValueError, match="no histogram"):
        sc.histogram_buckets(after, "vllm:nothing")


def test_percentiles_agree_within_a_bucket_and_not_beyond():
    # five values in (0, 0.1], five in (0.1, 0.2]
    buckets = [(0.1, 5.0), (0.2, 10.0), (math.inf, 10.0)]
    client = [0.05] * 5 + [0.15] * 5
    [p50, p90] = sc.percentile_agreement(client, buckets, (50, 90))
    # rank 5 of 10 ends the first bucket: histogram_quantile says 0.1; the client's 5th is 0.05
    assert (p50.server_s, p50.client_s, p50.bucket_s, p50.agree) == (0.1, 0.05, (0.0, 0.1), True)
    # rank 9: 0.1 + 0.1 * (9 - 5) / 5 = 0.18 in (0.1, 0.2]; the client's 9th value is 0.15
    assert p90.server_s == pytest.approx(0.18) and p90.client_s == 0.15 and p90.agree
    # a client that saw half a second more than the server's buckets can hold
    assert not any(a.agree for a in sc.percentile_agreement([0.5] * 10, buckets))


def test_time_average_and_littles_law_by_hand():
    assert sc.time_average([(0.0, 2.0), (1.0, 4.0), (3.0, 0.0)]) == pytest.approx(10 / 3)
    before = sc.parse_metrics(exposition([], [1.5], 1))
    after = sc.parse_metrics(exposition([], [1.5, 0.5, 2.5, 1.0], 4))  # 3 more, 4 s in all
    result = sc.littles_law(before, after, [(10.0, 1.0), (12.0, 2.0), (16.0, 0.0)])
    assert result["finished"] == 3 and result["window_s"] == 6.0
    assert result["lambda_rps"] == pytest.approx(0.5)
    assert result["w_s"] == pytest.approx(4.0 / 3)
    assert result["l_lambda_w"] == pytest.approx(2 / 3)
    assert result["l_measured"] == pytest.approx((1 * 2 + 2 * 4) / 6)


def test_on_a_live_server_the_counts_match_and_littles_law_holds_roughly():
    from minillm.serve import run_server

    llm = LLM(max_model_len=128, max_num_seqs=4)
    with run_server(llm, port=0) as server:
        target = loadgen.Target(server.url, server.parts.served_model_name)
        sessions = loadgen.fixed_sessions(9, 8, 8, seed=0, tokenizer=llm.get_tokenizer())
        before = sc.scrape(server.url)
        with sc.InSystemSampler(server.url, period_s=0.02) as sampler:
            run = loadgen.run(target, sessions, concurrency=3)
        after = sc.scrape(server.url)
    assert all(r.ok for r in run.records)
    ttft_buckets = sc.histogram_delta(before, after, sc.TTFT)
    assert ttft_buckets[-1][1] == 9  # every request of the run, no other
    client_ttfts = [r.token_times_s[0] - r.sent_s for r in run.records]
    agreement = sc.percentile_agreement(client_ttfts, ttft_buckets)
    assert [a.percentile for a in agreement] == [50, 90, 99]
    for a in agreement:  # the client's TTFT holds the server's and the HTTP round trip
        assert a.bucket_s[0] <= a.server_s <= a.bucket_s[1]
    law = sc.littles_law(before, after, sampler.samples)
    assert law["finished"] == 9
    # about 3 requests in the server the whole time, by either side of L = lambda W
    assert 0.25 < law["ratio"] < 4


def test_the_command_checks_a_server_that_wants_an_api_key(capsys):
    from minillm.serve import run_server

    llm = LLM(max_model_len=128, max_num_seqs=4)
    with run_server(llm, port=0, api_key="k", served_model_name="m") as server:
        argv = ["--base-url", server.url, "--num-requests", "2", "--concurrency", "1"]
        assert sc.main([*argv, "--api-key", "k", "--model", "m"]) == 0
    out = capsys.readouterr().out
    assert "ttft p50" in out and "Little's law" in out
