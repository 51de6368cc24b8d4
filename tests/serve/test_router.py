"""The router: its policies against brute-force expectations, and two live replicas behind it.

The live replicas serve the bundled model (the session's `llm` and `reference_llm`); a
request through the router must come back exactly as the same request sent straight to a
replica, streaming included.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.serve import run_server, start_server
from minillm.serve.router import (
    HashRing,
    RoundRobin,
    Router,
    is_imbalanced,
    least_outstanding,
    prefix_key,
    run_router,
)

names = st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=1, max_size=6, unique=True)


@given(candidates=names, calls=st.integers(0, 60))
def test_round_robin_is_balanced(candidates, calls):
    rr = RoundRobin()
    counts = dict.fromkeys(candidates, 0)
    for _ in range(calls):
        counts[rr.choose(candidates)] += 1
    n = len(candidates)
    assert [counts[c] for c in candidates] == [len(range(i, calls, n)) for i in range(n)]


@given(
    loads=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    turn=st.integers(0, 20),
)
def test_least_outstanding_picks_a_minimum_and_breaks_ties_in_turn(loads, turn):
    candidates = [f"r{i}" for i in range(len(loads))]
    outstanding = dict(zip(candidates, loads, strict=True))
    chosen = least_outstanding(candidates, outstanding, turn)
    n = len(candidates)
    # brute force: sort by (load, distance from the turn's position)
    expected = min(range(n), key=lambda i: (loads[i], (i - turn) % n))
    assert chosen == candidates[expected]
    assert outstanding[chosen] == min(loads)


KEYS = [f"tenant {i}: system prompt" for i in range(2000)]


def test_prefix_aware_is_deterministic_and_moves_about_one_in_n_plus_one_keys():
    nodes = [f"http://10.0.0.{i}:8000" for i in range(4)]
    ring = HashRing(nodes)
    before = {k: ring.lookup(k) for k in KEYS}
    assert before == {k: HashRing(list(reversed(nodes))).lookup(k) for k in KEYS}  # same ring
    assert set(before.values()) == set(nodes)
    ring.add("http://10.0.0.9:8000")
    after = {k: ring.lookup(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "http://10.0.0.9:8000" for k in moved)  # only to the new replica
    assert 0.5 / 5 < len(moved) / len(KEYS) < 1.5 / 5  # about 1/(N + 1) of them
    ring.remove("http://10.0.0.9:8000")
    assert {k: ring.lookup(k) for k in KEYS} == before


@given(down=st.sets(st.integers(0, 4), max_size=4), key=st.text(max_size=20))
def test_a_down_replica_s_keys_go_where_a_ring_without_it_sends_them(down, key):
    nodes = [f"n{i}" for i in range(5)]
    up = [n for i, n in enumerate(nodes) if i not in down]
    ring = HashRing(nodes, virtual_nodes=16)
    assert ring.lookup(key, set(up).__contains__) == HashRing(up, virtual_nodes=16).lookup(key)


def test_equal_prefixes_give_equal_keys():
    system = "You are a helpful assistant for tenant 7. " * 10
    a = {"prompt": system + "question one"}
    b = {"prompt": system + "a different question"}
    assert prefix_key(a, 64) == prefix_key(b, 64) == system[:64]
    assert prefix_key(a, 64) != prefix_key({"prompt": "x" + system}, 64)
    chat = [{"role": "system", "content": system}]
    assert prefix_key({"messages": [*chat, {"role": "user", "content": "hi"}]}, 64) == (
        prefix_key({"messages": [*chat, {"role": "user", "content": "bye"}]}, 64)
    )
    assert prefix_key({"prompt": [1, 2, 3, 4, 5]}, 8) == "1,2"
    assert prefix_key({"prompt": ["first", "second"]}) == "first"
    assert prefix_key(None) == prefix_key({}) == ""


def test_router_options_are_checked():
    with pytest.raises(ValueError, match="policy"):
        Router(["http://a:1"], "random")
    with pytest.raises(ValueError, match="replicas"):
        Router([])
    with pytest.raises(ValueError, match="replica"):
        Router(["a:1"])
    with pytest.raises(ValueError, match="twice"):
        Router(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="prefix_chars"):
        Router(["http://a:1"], "prefix_aware", prefix_chars=0)


@pytest.mark.parametrize(
    "loads, imbalanced",
    [
        ([0, 0], False),
        ([33, 0], True),  # 33 - 0 > 32 and 33 > 0
        ([32, 0], False),  # not more than 32 ahead
        ([100, 60], True),  # 40 ahead and 100 > 66
        ([100, 91], False),  # 100 < 91 * 1.1 = 100.1: relatively balanced
        ([5], False),
        ([], False),
    ],
)
def test_imbalance_needs_both_thresholds(loads, imbalanced):
    assert is_imbalanced(loads, 32, 1.1) is imbalanced


def test_prefix_aware_spills_to_the_least_busy_replica_when_out_of_balance():
    replicas = ["http://a:1", "http://b:1", "http://c:1"]
    router = Router(replicas, "prefix_aware", balance_abs_threshold=4, balance_rel_threshold=1.5)
    body = {"prompt": "the shared system prompt " * 20}
    home = router.choose(body)
    # balanced: every request of the prefix goes home, even with some load there
    router.outstanding[home] = 4
    assert {router.choose(body) for _ in range(5)} == {home}
    # the home replica 5 ahead of an idle one: the next goes to the least busy replica
    router.outstanding[home] = 5
    others = [r for r in replicas if r != home]
    router.outstanding[others[0]] = 1
    assert router.choose(body) == others[1]
    assert router.spilled_total == 1
    assert "minillm_router_balance_spills_total 1" in router.render_metrics()
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        Router(replicas, "prefix_aware", balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        Router(replicas, "prefix_aware", balance_abs_threshold=-1)


def test_router_command_line():
    from minillm.cli.main import build_parser

    argv = ["router", "--replica", "http://a:1", "http://b:2", "--replica", "http://c:3"]
    args = build_parser("router").parse_args([*argv, "--policy", "prefix_aware"])
    assert args.replica == ["http://a:1", "http://b:2", "http://c:3"]
    assert (args.policy, args.prefix_chars) == ("prefix_aware", 256)
    assert (args.balance_abs_threshold, args.balance_rel_threshold) == (32, 1.1)


def test_choose_skips_a_replica_marked_down_until_its_time_is_up():
    now = [0.0]
    router = Router(["http://a:1", "http://b:1"], down_for_s=5.0, clock=lambda: now[0])
    router.mark_down("http://a:1")
    assert {router.choose({}) for _ in range(4)} == {"http://b:1"}
    router.mark_down("http://b:1")
    assert router.choose({}) is None
    now[0] = 5.0
    assert {router.choose({}) for _ in range(4)} == {"http://a:1", "http://b:1"}


# ---------------------------------------------------------------------- live


def free_port_url() -> str:
    """A URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def completion(url: str, prompt: str, stream: bool = False) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def texts_of(response: httpx.Response, stream: bool) -> str:
    if not stream:
        return response.json()["choices"][0]["text"]
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def per_replica(metrics_text: str, name: str) -> dict[str, float]:
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = float(line.rsplit(" ", 1)[1])
    return out


def test_two_replicas_behind_the_router_answer_as_a_direct_request(llm, reference_llm):
    prompts = ["def add(a, b):", "The weather today", "import numpy as"]
    b = start_server(reference_llm, port=0)
    try:
        with run_server(llm, port=0) as a:
            direct = {p: texts_of(completion(a.url, p), False) for p in prompts}
            with run_router([a.url, b.url], "round_robin") as router:
                for stream in (False, True):
                    for p in prompts:
                        r = completion(router.url, p, stream)
                        assert r.status_code == 200
                        assert texts_of(r, stream) == direct[p]
                metrics = httpx.get(router.url + "/metrics").text
                assert per_replica(metrics, "minillm_router_requests_total") == {
                    a.url: 3.0,
                    b.url: 3.0,
                }
                assert set(
                    per_replica(metrics, "minillm_router_outstanding_requests").values()
                ) == {0.0}
                assert httpx.get(router.url + "/health").json() == {a.url: True, b.url: True}
                models = httpx.get(router.url + "/v1/models")
                assert models.status_code == 200 and models.json()["data"]

                # the same prefix always goes to the same replica
                router.router.policy = "prefix_aware"
                system = "You answer questions about the tenant's invoices. " * 6
                for i in range(4):
                    assert completion(router.url, system + f"question {i}").status_code == 200
                counts = per_replica(
                    httpx.get(router.url + "/metrics").text, "minillm_router_requests_total"
                )
                assert sorted(counts.values()) == [3.0, 7.0]  # 3 round robin + 4 on one

                # one replica dies: the other takes every request (in turn, b is tried)
                router.router.policy = "round_robin"
                b.stop()
                for p in prompts:
                    r = completion(router.url, p)
                    assert r.status_code == 200 and texts_of(r, False) == direct[p]
                failures = per_replica(
                    httpx.get(router.url + "/metrics").text,
                    "minillm_router_connect_failures_total",
                )
                assert failures[a.url] == 0 and failures[b.url] >= 1
    finally:
        b.stop()


def test_no_replica_left_is_a_clear_503():
    dead = [free_port_url(), free_port_url()]
    with run_router(dead, "least_outstanding") as router:
        r = completion(router.url, "hello")
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "no_replica_available"
        assert all(url in error["message"] for url in dead)
        assert httpx.get(router.url + "/health").status_code == 503


def test_the_routing_bench_reads_counters_over_every_label_set():
    from minillm.lab.routing_bench import counter_total

    text = (
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{model_name="a"} 30.0\n'
        'vllm:prefix_cache_hits_total{model_name="b"} 12.0\n'
        "vllm:prefix_cache_hits_created 1.7e9\n"
        "vllm:prefix_cache_queries_total 100.0\n"
    )
    assert counter_total(text, "vllm:prefix_cache_hits_total") == 42.0
    assert counter_total(text, "vllm:prefix_cache_queries_total") == 100.0


def test_a_replica_s_429_comes_through_with_its_headers(llm):
    from minillm.serve.rate_limit import RateLimiter

    now = [0.0]
    cost = len(llm.engine.tokenizer.encode("hello there")) + 6
    limiter = RateLimiter(60, burst_tokens=cost, clock=lambda: now[0])
    body = {"prompt": "hello there", "max_tokens": 6, "ignore_eos": True}
    with run_server(llm, port=0, rate_limiter=limiter) as server:
        with run_router([server.url], "round_robin") as router:
            first = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
            second = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    assert first.status_code == 200
    assert second.status_code == 429
    assert second.headers["Retry-After"] == str(cost)  # one token a second, all of it spent
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    assert second.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_short_system_prompt_still_keys_a_tenant():
    # a 120-character system prompt is shorter than the 256-character key: the key must
    # not take in the user's text, or each tenant's requests scatter over the replicas
    ring = HashRing([f"http://127.0.0.1:800{i}" for i in range(1, 4)])
    for tenant in "ABCDEFGH":
        system = (f"Tenant {tenant} system prompt. " * 10)[:120]
        owners = {
            ring.lookup(
                prefix_key(
                    {
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"User question number {q}: ..."},
                        ]
                    }
                )
            )
            for q in range(10)
        }
        assert len(owners) == 1
    # without a system message the key is the conversation's first characters, as before
    talk = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert prefix_key({"messages": talk}) == "user:hello\nassistant:hi\n"
    assert prefix_key({"messages": [{"role": "developer", "content": "be terse"}, *talk]}) == (
        "developer:be terse\n"
    )


def test_the_router_refuses_a_foreign_host_before_forwarding(llm):
    """DNS rebinding reaches a router on localhost as it reaches a server: a foreign Host is
    a 400 in OpenAI's JSON and no replica sees the request; its own names are served."""
    with run_server(llm, port=0) as server:
        with run_router([server.url], "round_robin", allowed_hosts=["edge.lan"]) as router:
            steps = server.engine.scheduler.num_steps
            r = httpx.post(
                router.url + "/v1/completions",
                json={"prompt": "x", "max_tokens": 4},
                headers={"host": "attacker.example"},
                timeout=60,
            )
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "invalid_host"
            assert "--allowed-hosts attacker.example" in r.json()["error"]["message"]
            assert server.engine.scheduler.num_steps == steps
            assert router.router.requests_total[server.url] == 0
            for host in ["localhost", "127.0.0.1:9", "Edge.LAN:8000"]:
                answer = httpx.get(router.url + "/metrics", headers={"host": host})
                assert answer.status_code == 200
    with run_router([free_port_url()], allowed_hosts=["*"]) as router:
        answer = httpx.get(router.url + "/metrics", headers={"host": "any.example"})
        assert answer.status_code == 200


def test_router_allowed_hosts_are_checked_and_parsed():
    from minillm.cli.main import build_parser

    with pytest.raises(ValueError, match="host names"):
        Router(["http://a:1"], allowed_hosts=["http://a.example/"])
    args = build_parser("router").parse_args(
        ["router", "--replica", "http://a:1", "--allowed-hosts", "a.lan", "b.lan"]
    )
    assert args.allowed_hosts == ["a.lan", "b.lan"]
