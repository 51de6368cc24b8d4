"""The load generator against a test double whose delays are known.

Sleeps never end early, so what the double waits is a lower bound of what the client must
measure; the tests assert such bounds, counts and payloads, never a speed.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from minillm.lab import loadgen
from minillm.lab import serving_metrics as sm

from .openai_double import OpenAIDouble, WordTokenizer


@pytest.fixture(scope="module")
def double():
    with OpenAIDouble() as server:
        yield server


def target(double, **options) -> loadgen.Target:
    return loadgen.Target(double.base_url, "double", **options)


def test_open_loop_measures_the_known_delays(double):
    double.reset(first_token_delay_s=0.05, gap_s=0.02)
    sessions = loadgen.fixed_sessions(4, 5, 3, seed=0)
    result = loadgen.run(target(double), sessions, request_rate=math.inf, tokenizer=WordTokenizer())
    assert [r.session for r in result.records] == [0, 1, 2, 3]
    for r in result.records:
        assert r.ok and r.text == " w0 w1 w2"
        assert len(r.token_times_s) == 3
        assert sm.ttft_s(r.scheduled_s, r.token_times_s) >= 0.05
        # a chunk reaches the client after the server sent it; a gap seen by the client can
        # be shorter than the server's (the earlier chunk was held up), the time since start not
        assert all(t - r.scheduled_s >= 0.05 + i * 0.02 for i, t in enumerate(r.token_times_s))
        assert r.output_tokens == 3 and r.retokenized_output_tokens == 3
    summary = loadgen.summarize(result, sm.Slo(ttft_s=10.0))
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["output_tokens"] == 12 and summary["output_chunks"] == 12
    assert summary["retokenized_minus_usage"] == 0
    assert summary["ttft_s"]["p50"] >= 0.05 and summary["e2el_s"]["p50"] >= 0.05 + 2 * 0.02
    assert summary["goodput_rps"] == pytest.approx(summary["request_throughput_rps"])
    payload = double.state.payloads[0]
    assert payload["stream"] and payload["stream_options"] == {"include_usage": True}
    assert payload["ignore_eos"] is True and payload["max_tokens"] == 3
    assert payload["prompt"].startswith(result.salt)


def test_usage_and_retokenized_counts_are_both_reported(double):
    double.reset(usage_offset=1)
    result = loadgen.run(
        target(double),
        loadgen.fixed_sessions(2, 4, 2, seed=0),
        concurrency=1,
        tokenizer=WordTokenizer(),
    )
    summary = loadgen.summarize(result)
    assert summary["output_tokens_usage"] == 6
    assert summary["output_tokens_retokenized"] == 4
    assert summary["retokenized_minus_usage"] == -2


def test_open_loop_counts_the_wait_of_a_late_send(double):
    # one slot that serves each request for >= 0.1 s, requests due every 0.02 s: the cap of one
    # in flight makes the client late, and the lateness is latency
    double.reset(first_token_delay_s=0.1, serial=True)
    sessions = loadgen.fixed_sessions(4, 3, 1, seed=0)
    starts = [0.0, 0.02, 0.04, 0.06]
    records = loadgen.run_sync(
        loadgen.run_open_loop(target(double), sessions, starts, max_concurrency=1)
    )
    late = sm.late_sends([r.timing() for r in records], tolerance_s=0.05)
    assert late == [1, 2, 3]
    for k, r in enumerate(records):
        # served after the k requests before it: done no earlier than (k + 1) * 0.1 s
        assert r.end_s >= (k + 1) * 0.1
        from_schedule = sm.ttft_s(r.scheduled_s, r.token_times_s)
        from_send = sm.ttft_s(r.sent_s, r.token_times_s)
        assert from_schedule >= (k + 1) * 0.1 - starts[k]
        assert from_schedule - from_send == pytest.approx(r.sent_s - r.scheduled_s)


def test_closed_loop_keeps_concurrency_in_flight(double):
    # each request holds its slot long enough that, even on a loaded machine, the second
    # client's first request starts before the first client's ends
    double.reset(first_token_delay_s=0.25)
    result = loadgen.run(target(double), loadgen.fixed_sessions(6, 3, 2, seed=0), concurrency=2)
    assert double.state.max_in_flight == 2
    assert result.mode == "closed" and len(result.records) == 6
    # sent as soon as due: no wait for a slot, which would last a request's 0.25 s. The margin
    # allows for the double's server thread holding the GIL (a switch interval is 5 ms)
    assert all(r.sent_s == pytest.approx(r.scheduled_s, abs=0.05) for r in result.records)


def test_multi_turn_sends_the_history(double):
    double.reset()
    sessions = loadgen.multi_turn_sessions(1, 3, 4, 2, seed=0)
    result = loadgen.run(target(double), sessions, concurrency=1, salt="")
    assert [r.turn for r in result.records] == [0, 1, 2]
    prompts = [p["prompt"] for p in double.state.payloads]
    turns = sessions[0].turns
    assert prompts[0] == turns[0].text
    assert prompts[1] == turns[0].text + " w0 w1" + turns[1].text
    assert prompts[2] == prompts[1] + " w0 w1" + turns[2].text
    # each turn is due when the previous one has ended
    for earlier, later in zip(result.records, result.records[1:], strict=False):
        assert later.scheduled_s >= earlier.end_s


def test_chat_endpoint_sends_messages(double):
    double.reset()
    sessions = loadgen.multi_turn_sessions(1, 2, 3, 2, seed=0)
    result = loadgen.run(
        target(double, endpoint="chat", ignore_eos=False), sessions, concurrency=1, salt="s: "
    )
    assert all(r.ok for r in result.records)
    second = double.state.payloads[1]
    assert "ignore_eos" not in second
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][0]["content"] == "s: " + sessions[0].turns[0].text
    assert second["messages"][1]["content"] == " w0 w1"


def test_errors_are_counted_not_timed(double):
    double.reset(reject_substring="REJECT")
    sessions = [
        loadgen.Session((loadgen.Turn("fine", 2),)),
        loadgen.Session((loadgen.Turn("REJECT me", 2),)),
    ]
    result = loadgen.run(target(double), sessions, request_rate=math.inf)
    assert result.records[0].ok and not result.records[1].ok
    assert result.records[1].error.startswith("HTTP 400")
    summary = loadgen.summarize(result, sm.Slo(ttft_s=10.0))
    assert summary["completed"] == 1 and summary["failed"] == 1
    assert summary["goodput_rps"] == pytest.approx(1 / summary["duration_s"])


def test_runs_are_salted_apart_and_prefixes_shared_within(double):
    sessions = loadgen.shared_prefix_sessions(4, 2, 6, 3, 1, seed=0)
    assert sessions[0].turns[0].text.split()[:6] == sessions[2].turns[0].text.split()[:6]
    a = loadgen.salted(sessions, "run a: ")
    assert a[0].turns[0].text == "run a: " + sessions[0].turns[0].text
    double.reset()
    first = loadgen.run(target(double), sessions, concurrency=4)
    second = loadgen.run(target(double), sessions, concurrency=4)
    assert first.salt != second.salt


def test_arrival_times():
    assert loadgen.arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    for burstiness in (0.5, 1.0, 4.0):
        starts = np.array(loadgen.arrival_times(20001, 5.0, seed=0, burstiness=burstiness))
        gaps = np.diff(starts)
        assert starts[0] == 0.0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        # gamma gaps: the squared coefficient of variation is 1 / shape
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.1)
    with pytest.raises(ValueError):
        loadgen.arrival_times(3, 0.0, 0)


def test_dataset_file(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "a b", "max_tokens": 3}\n\n{"turns": ["x", "y"]}\n')
    sessions = loadgen.dataset_sessions(str(path), 7)
    assert sessions == [
        loadgen.Session((loadgen.Turn("a b", 3),)),
        loadgen.Session((loadgen.Turn("x", 7), loadgen.Turn("y", 7))),
    ]
    for bad in (
        '{"prompt": 3}',
        '{"turns": []}',
        '{"prompt": "a", "max_tokens": 0}',
        "[1]",
        "not json",
    ):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="requests.jsonl:1"):
            loadgen.dataset_sessions(str(path), 7)


def test_abba_order_and_compare():
    assert loadgen.abba_order(2) == list("ABBAABBA")
    calls = []

    def runner(label, value):
        def go():
            calls.append(label)
            return {"output_throughput_tps": value + len(calls) * 0.0}

        return go

    result = loadgen.compare(runner("A", 10.0), runner("B", 12.0), rounds=1)
    assert calls == ["A", "B", "B", "A"]
    assert result["ratio_b_over_a"] == pytest.approx(1.2)
    assert result["aa_spread"] == pytest.approx(1.0)


def test_the_command_runs_a_sweep_and_writes_json(double, tmp_path):
    from minillm.cli.main import main

    double.reset(first_token_delay_s=0.01, gap_s=0.005)
    out = tmp_path / "serve.json"
    plot = tmp_path / "serve.png"
    status = main(
        [
            "bench",
            "serve",
            "--base-url",
            double.base_url,
            "--tokenizer",
            "minillm-stdlib-target",
            "--num-requests",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--request-rate",
            "50",
            "inf",
            "--concurrency",
            "2",
            "--warmup",
            "1",
            "--slo-ttft-ms",
            "1000",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert status == 0
    record = json.loads(out.read_text())
    assert record["model"] == "double" and record["warmup_requests"] == 1
    assert [(p["mode"], p["load"]) for p in record["points"]] == [
        ("open", 50.0),
        ("open", math.inf),
        ("closed", 2.0),
    ]
    assert all(p["completed"] == 4 and p["output_tokens"] == 12 for p in record["points"])
    assert plot.stat().st_size > 0
    # warm-up: 1 request, then 3 runs of 4
    assert len(double.state.payloads) == 13


def test_tpot_divides_by_tokens_not_chunks(double):
    # 12 tokens in 3 chunks of 4, 0.05 s apart: TPOT is the 0.1 s of the last two chunks
    # over the 11 tokens after the first, as vLLM 0.11's benchmark computes it; ITL stays
    # per chunk (two gaps of >= 0.05 s per request)
    double.reset(tokens_per_chunk=4, gap_s=0.05)
    result = loadgen.run(target(double), loadgen.fixed_sessions(2, 4, 12, seed=0), concurrency=1)
    for r in result.records:
        assert r.ok and len(r.token_times_s) == 3 and r.output_tokens == 12
        span = r.token_times_s[-1] - r.token_times_s[0]
        # computed here from the recorded times, not by the module under test
        assert r.timing().end_s == r.token_times_s[-1]
        assert loadgen.sm.tpot_s(r.scheduled_s, r.token_times_s, r.token_times_s[-1], 12) == (
            pytest.approx(span / 11)
        )
    summary = loadgen.summarize(result)
    spans = [r.token_times_s[-1] - r.token_times_s[0] for r in result.records]
    assert summary["tpot_s"]["mean"] == pytest.approx(sum(s / 11 for s in spans) / 2)
    # ITL is one value per gap between chunks (4 here), not per token: nearest-rank p50 of 4
    # values is the 2nd smallest
    gaps = sorted(b - a for r in result.records for a, b in itertools.pairwise(r.token_times_s))
    assert len(gaps) == 4
    assert summary["itl_s"]["p50"] == pytest.approx(gaps[1])
    assert summary["output_tokens"] == 24 and summary["output_chunks"] == 6
    assert summary["chunks_per_request"]["mean"] == 3


def test_tpot_falls_back_to_the_retokenized_count_without_usage():
    record = loadgen.RequestRecord(0, 0, 0.0, 0.0, [1.0, 2.0, 3.0], 3.5, " a b c d e f g")
    assert record.timing().num_tokens is None
    record.retokenized_output_tokens = 7
    timing = record.timing()
    assert timing.num_tokens == 7 and timing.end_s == 3.0
    assert sm.tpot_s(0.0, timing.token_times_s, timing.end_s, 7) == pytest.approx(2.0 / 6)
    record.output_tokens = 5  # the server's usage wins over the re-tokenized count
    assert record.timing().num_tokens == 5


def test_e2el_ends_at_the_last_chunk_not_the_usage_chunk(double):
    double.reset(gap_s=0.01, usage_delay_s=0.3)
    result = loadgen.run(target(double), loadgen.fixed_sessions(1, 4, 3, seed=0), concurrency=1)
    (r,) = result.records
    assert r.end_s - r.token_times_s[-1] >= 0.3  # the stream really ended late
    summary = loadgen.summarize(result)
    assert summary["e2el_s"]["p50"] == pytest.approx(r.token_times_s[-1] - r.scheduled_s)
    assert summary["tpot_s"]["p50"] == pytest.approx((r.token_times_s[-1] - r.token_times_s[0]) / 2)


def test_a_stream_ending_in_an_error_event_fails(double):
    double.reset(error_after_chunks=2)
    result = loadgen.run(target(double), loadgen.fixed_sessions(2, 4, 5, seed=0), concurrency=1)
    for r in result.records:
        assert len(r.token_times_s) == 2 and not r.ok
        assert "error event after 2 chunks" in r.error and "aborted" in r.error
    summary = loadgen.summarize(result)
    assert summary["completed"] == 0 and summary["failed"] == 2
    assert any("aborted" in e for e in summary["errors"])


def test_progress_counts_each_request_as_it_ends(double):
    import io

    double.reset()
    stream = io.StringIO()
    progress = loadgen.Progress(stream)
    seen = []

    def on_done(record):
        seen.append(len(stream.getvalue()))
        progress(record)

    loadgen.run(
        target(double), loadgen.fixed_sessions(3, 4, 2, seed=0), concurrency=1, on_done=on_done
    )
    assert len(seen) == 3 and seen == sorted(seen)
    assert stream.getvalue().endswith("\r  3 done, 0 failed")


def test_warm_up_that_fails_entirely_stops_with_the_reason(double):
    double.reset(reject_substring="warm-up")
    with pytest.raises(RuntimeError, match="all 2 warm-up requests.*HTTP 400.*rejected"):
        loadgen.warm_up(target(double), 2)


def test_the_command_prints_failure_reasons_and_needs_a_tokenizer(double, capsys):
    from minillm.cli.main import main

    double.reset(error_after_chunks=1)
    args = ["bench", "serve", "--base-url", double.base_url, "--num-requests", "2"]
    args += ["--input-len", "4", "--output-len", "3", "--concurrency", "1", "--warmup", "0"]
    assert main(args) != 0
    assert "serves 'double'" in capsys.readouterr().err
    assert main([*args, "--tokenizer", "minillm-stdlib-target"]) == 0
    out = capsys.readouterr()
    assert "failed: error event after 1 chunks: the engine aborted the request" in out.out
    assert "0 done, 2 failed" in out.err


def test_default_tokenizer_is_the_served_models_when_local(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert loadgen.default_tokenizer(str(tmp_path)) == str(tmp_path)
    assert loadgen.default_tokenizer("minillm-stdlib-target").endswith("minillm-stdlib-target")
    with pytest.raises(ValueError, match="meta-llama/Llama-3.1-8B"):
        loadgen.default_tokenizer("meta-llama/Llama-3.1-8B")
