"""Chapters 9 and 10's diagrams show a request's real timestamps, the SLO test, the
router's real choices, the token bucket's real answers and a cold start's phases."""

import math
import pathlib

import pytest

from minillm.core.metrics import RequestMetrics
from minillm.lab import serving_metrics as sm
from minillm.lab.cold_start import ColdStart
from minillm.lab.diagrams import serving as s
from minillm.serve.rate_limit import TokenBucket
from minillm.serve.router import HashRing, prefix_key

REPLICAS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"]


def request(queue_s: float) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=100.0,
        first_scheduled_time=100.0 + queue_s,
        token_times=[100.0 + queue_s + 0.02 + 0.01 * i + (0.05 if i >= 4 else 0) for i in range(8)],
        finished_time=100.0 + queue_s + 0.02 + 0.07 + 0.05,
    )


def texts(c) -> list[str]:
    return [t.get_text() for t in c.ax.texts]


def test_timeline_carries_the_request_metrics():
    m = request(0.03)
    c = s.draw_request_timeline(m)
    assert c.timeline["queue_ms"] == pytest.approx(30.0)
    assert c.timeline["ttft_ms"] == pytest.approx(m.ttft_s * 1e3)
    assert c.timeline["num_tokens"] == 8
    t = texts(c)
    assert f"TTFT {m.ttft_s * 1e3:.1f} ms" in t
    assert "widest ITL gap 60.0 ms" in t  # the gap before token 4: 10 ms + 50 ms
    assert any(f"E2EL {m.e2el_s * 1e3:.1f} ms for 8 tokens" in x for x in t)
    later = s.draw_request_timeline(request(0.2))
    assert later.timeline["queue_ms"] == pytest.approx(200.0)
    assert later.timeline["ttft_ms"] > c.timeline["ttft_ms"]


def test_slo_outcomes_agree_with_meets_slo():
    timings = [
        sm.RequestTiming(0.0, 0.0, (0.1 * k + 0.05, 0.1 * k + 0.06, 0.1 * k + 0.08), 0.1 * k + 0.08)
        for k in range(5)
    ]
    slo = sm.Slo(ttft_s=0.2, tpot_s=0.02)
    out = s.slo_outcomes(timings, slo)
    assert [o.meets for o in out] == [sm.meets_slo(t, slo) for t in timings]
    assert [o.meets_ttft for o in out] == [True, True, False, False, False]
    assert all(o.meets_tpot for o in out)
    fig = s.plot_slo_requests([("run", timings)], slo)
    assert fig.axes[0].get_title() == "run: 2 of 5 good"


def test_router_diagram_is_the_routers_choice():
    bodies = [
        {"prompt": f"tenant {t} system prompt " * 20 + f"q{i}"} for i, t in enumerate("AABBACBC")
    ]
    names = [f"{t}{i}" for i, t in enumerate("AABBACBC")]
    lasts = [6, 1, 1, 5, 1, 1, 1, 1]
    c = s.draw_router(bodies, names, REPLICAS, lasts)
    assert c.assignment["round_robin"] == [REPLICAS[i % 3] for i in range(8)]
    ring = HashRing(REPLICAS)
    assert c.assignment["prefix_aware"] == [ring.lookup(prefix_key(b)) for b in bodies]
    # least outstanding avoids the replicas still holding the long requests 0 and 3
    lo = c.assignment["least_outstanding"]
    assert lo[4] not in (lo[0], lo[3])
    assert len(set(lo[:3])) == 3
    # the boxes list each replica's requests in order
    assert c.labels()[:8] == ["A0", "B3", "B6", "A1", "A4", "C7", "B2", "C5"]


def test_token_bucket_events_are_the_buckets_answers():
    requests = [(0.0, 600), (1.0, 600), (2.0, 300), (5.0, 600)]
    samples, events = s.replay_bucket(100.0, 1000.0, requests)
    now = [0.0]
    bucket = TokenBucket(100.0, 1000.0, clock=lambda: now[0])
    for (t, cost), e in zip(requests, events, strict=True):
        now[0] = t
        assert e.wait_s == pytest.approx(bucket.try_take(cost))
    assert events[1].wait_s == pytest.approx(1.0)  # 400 left + 100 refilled, 600 asked
    assert [e.wait_s == 0 for e in events] == [True, False, True, True]
    assert max(level for _, level in samples) <= 1000.0 + 1e-9
    fig = s.plot_token_bucket(100.0, 1000.0, requests)
    notes = [t.get_text() for t in fig.axes[0].texts]
    assert f"600:\n429\nRetry-After\n{math.ceil(events[1].wait_s)} s" in notes
    assert notes.count("600:\nadmitted") == 2


def test_autoscaler_draws_the_measured_phases():
    cold = ColdStart(0.05, 1.6, 0.9, 0.4, 0.01, 0.2, 0.15, 3.31, 0.02)
    c = s.draw_autoscaler(cold)
    t = texts(c)
    assert "import torch\n1.60 s" in t and "import minillm\n0.90 s" in t
    assert any("process 50 ms" in x and "allocate kv 10 ms" in x for x in t)
    assert "its cold start, measured here: 3.3 s" in t
    slower = ColdStart(0.05, 1.6, 0.9, 4.0, 0.01, 0.2, 0.15, 6.91, 0.02)
    assert "load weights\n4.00 s" in texts(s.draw_autoscaler(slower))


def test_multi_lora_rows_name_their_adapters():
    labels = s.draw_multi_lora(["sql", None, "chat"], rank=16, hidden=256).labels()
    assert labels.count("x Wᵀ\nshared") == 1
    assert [x for x in labels if x.startswith("+") or x == "base only"] == [
        "+ x Aᵀ Bᵀ of sql",
        "base only",
        "+ x Aᵀ Bᵀ of chat",
    ]


def test_engine_processes_are_drawn_in_order():
    c = s.draw_engine_processes()
    labels = c.labels()
    assert labels[0].startswith("API server") and labels[2].startswith("Worker")
    assert labels[3].startswith("HTTP server") and labels[-1] == "DetokenizerManager process"
    small = s.draw_engine_processes({"one": [("a", "request"), ("b", "host")]})
    assert small.labels() == ["a", "b"]


def test_service_layer_places_each_system_against_minillms_parts():
    root = pathlib.Path(s.__file__).resolve().parents[3]
    assert list(s.SERVICE_PARTS) == ["router", "autoscaler", "engine", "KV cache", "metrics"]
    assert all((root / path).is_file() for path in s.SERVICE_PARTS.values())
    assert list(s.SERVICE_SYSTEMS) == ["llm-d", "NVIDIA Dynamo", "KServe", "KEDA"]
    # the placements the chapter's prose states
    assert "prefix" in s.SERVICE_SYSTEMS["llm-d"]["router"]
    assert "KV events" in s.SERVICE_SYSTEMS["NVIDIA Dynamo"]["router"]
    assert "Planner" in s.SERVICE_SYSTEMS["NVIDIA Dynamo"]["autoscaler"]
    assert sorted(s.SERVICE_SYSTEMS["KEDA"]) == ["autoscaler", "metrics"]  # no router, no engine
    assert "engine" in s.SERVICE_SYSTEMS["KServe"] and "KV cache" not in s.SERVICE_SYSTEMS["KServe"]

    labels = s.draw_service_layer().labels()
    parts = [f"{p}\n{path.removeprefix('minillm/')}" for p, path in s.SERVICE_PARTS.items()]
    assert labels[:5] == parts
    cells = [label for row in s.SERVICE_SYSTEMS.values() for label in row.values()]
    assert labels[5:] == [
        row[p] for row in s.SERVICE_SYSTEMS.values() for p in s.SERVICE_PARTS if p in row
    ]
    assert len(labels) == 5 + len(cells)


def test_service_layer_refuses_a_part_minillm_does_not_have():
    with pytest.raises(ValueError, match=r"parts \['gateway'\]"):
        s.draw_service_layer(systems={"X": {"gateway": "y"}})
    small = s.draw_service_layer({"router": "a.py", "engine": "b.py"}, {"X": {"engine": "e"}})
    assert small.labels() == ["router\na.py", "engine\nb.py", "e"]
