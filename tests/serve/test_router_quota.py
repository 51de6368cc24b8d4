"""Token quotas kept in the router: one bucket per key for the whole deployment.

Two live replicas of the bundled model (the session's `llm` and `reference_llm`) behind a
router whose RateLimiter runs on a fake clock, so that nothing refills during a test. The
oracles are the replicas themselves: what they report in `usage`, what their own limiter
asks in a 429, how many requests their metrics saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.serve import run_server
from minillm.serve.rate_limit import RateLimiter
from minillm.serve.router import Router, UsageMeter, run_router
from tests.serve.conftest import ENGINE_OPTIONS, greedy

PROMPT = "The capital of France is"
MAX_MODEL_LEN = ENGINE_OPTIONS["max_model_len"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


KEYS = ["tenant-a", "tenant-b", "tenant", "t0"]


def limiter(burst: int) -> RateLimiter:
    """60 tokens per minute (one a second) on a clock that never moves."""
    return RateLimiter(60, burst_tokens=burst, clock=FakeClock())


@contextlib.contextmanager
def deployment(llm, reference_llm, rate_limiter: RateLimiter, api_key=KEYS):
    """Two replicas behind a round-robin router that keeps the quota and checks the keys."""
    with run_server(llm, port=0) as a, run_server(reference_llm, port=0) as b:
        with run_router(
            [a.url, b.url],
            rate_limiter=rate_limiter,
            max_model_len=MAX_MODEL_LEN,
            api_key=api_key,
        ) as router:
            yield router, (a, b)


def finished_requests(server) -> float:
    """Requests a replica has finished, from its own metrics."""
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def router_counter(router, name: str) -> float:
    lines = httpx.get(router.url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def settled(router) -> None:
    """Wait for the router to finish its answers (their tokens are settled by then)."""
    deadline = time.monotonic() + 10
    while any(router.router.outstanding.values()):
        assert time.monotonic() < deadline, "the router still holds requests"
        time.sleep(0.01)


def post(router, body: dict, key: str | None = "t0", path="/v1/completions") -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    response = httpx.post(router.url + path, json=body, headers=headers, timeout=60)
    settled(router)
    return response


def num_tokens(llm, text: str) -> int:
    return len(llm.engine.tokenizer.encode(text))


def test_a_key_gets_its_quota_once_behind_two_replicas_not_twice(llm, reference_llm):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    cost = num_tokens(llm, PROMPT) + 4
    burst = 3 * cost + cost // 2  # three requests and half of a fourth
    quota = limiter(burst)
    with deployment(llm, reference_llm, quota) as (router, replicas):

        async def burst_of(n: int, key: str) -> list[httpx.Response]:
            headers = {"Authorization": f"Bearer {key}"}
            async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
                return await asyncio.gather(
                    *(client.post("/v1/completions", json=body, headers=headers) for _ in range(n))
                )

        responses = asyncio.run(burst_of(8, "tenant-a"))
        settled(router)
        admitted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        # per-replica buckets would admit 3 on each replica: 6 of the 8
        assert (len(admitted), len(refused)) == (3, 5)
        reserved = sum(r.json()["usage"]["total_tokens"] for r in admitted)  # no refund due
        assert reserved == 3 * cost <= burst
        for r in refused:
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
            assert r.headers["Retry-After"] == str(cost - cost // 2)  # one token a second
            assert r.headers["x-ratelimit-remaining-tokens"] == str(cost // 2)
            assert r.headers["x-ratelimit-limit-tokens"] == "60"
        # the refused requests never reached a replica
        assert sum(finished_requests(s) for s in replicas) == 3
        assert router_counter(router, "minillm_router_requests_total") == 3
        assert router_counter(router, "minillm_router_rate_limited_total") == 5

        # another key has its own bucket; tenant-a's is still empty
        assert post(router, body, "tenant-b").status_code == 200
        assert post(router, body, "tenant-a").status_code == 429
        # a key the router does not know: 401, and no bucket
        assert post(router, body, "made-up").status_code == 401
        assert post(router, body, None).status_code == 401
        assert sum(finished_requests(s) for s in replicas) == 3 + 1


def test_without_keys_the_router_keeps_one_bucket_for_every_client(llm, reference_llm):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    cost = num_tokens(llm, PROMPT) + 4
    burst = 3 * cost + cost // 2
    quota = limiter(burst)
    with deployment(llm, reference_llm, quota, api_key=None) as (router, replicas):
        # made-up keys, or none, draw on one bucket, whichever replica serves
        codes = [
            post(router, body, None if i == 0 else f"made-up-{i}").status_code for i in range(4)
        ]
        assert codes == [200, 200, 200, 429]
        assert quota.remaining("") == burst - 3 * cost
        assert sum(finished_requests(s) for s in replicas) == 3


@pytest.mark.parametrize("stream", ["no", "with usage", "without usage"])
def test_unused_tokens_come_back_so_the_next_request_fits(llm, reference_llm, stream):
    text = greedy(reference_llm, [PROMPT], 20)[0]
    stop = text[len(text) // 4]  # a character early in the greedy output
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0.0, "stop": [stop]}
    num_prompt = num_tokens(llm, PROMPT)
    cost = num_prompt + 20
    burst = 2 * cost - 1  # without a refund the second request cannot fit
    quota = limiter(burst)
    with deployment(llm, reference_llm, quota) as (router, _):
        truth = post(router, body, "t0").json()["usage"]  # another key, to learn the usage
        assert truth["completion_tokens"] < 20  # it stopped early: the premise of the test
        if stream != "no":
            body = {**body, "stream": True}
        if stream == "with usage":
            body["stream_options"] = {"include_usage": True}
        first = post(router, body, "tenant")
        assert first.status_code == 200
        charged = burst - quota.remaining("tenant")
        if stream == "without usage":  # counted from the chunks: at least one, at most 20
            assert num_prompt + 1 <= charged < cost
            assert abs(charged - truth["total_tokens"]) <= 1
        else:
            assert charged == truth["total_tokens"]
        second = post(router, body, "tenant")
        assert second.status_code == 200


def test_a_request_larger_than_the_burst_is_refused_for_good(llm, reference_llm):
    with deployment(llm, reference_llm, limiter(50)) as (router, replicas):
        r = post(router, {"prompt": PROMPT, "max_tokens": 200})
        assert r.status_code == 429
        assert "Retry-After" not in r.headers and "x-ratelimit-reset-tokens" not in r.headers
        assert "Request too large" in r.json()["error"]["message"]
        assert sum(finished_requests(s) for s in replicas) == 0


BODIES = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 7}),
    ("/v1/completions", {"prompt": PROMPT}),  # OpenAI's default max_tokens, 16
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": None}),  # what max_model_len leaves
    ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 3, "n": 2}),
    ("/v1/completions", {"prompt": ["one prompt", "and a longer second one"], "n": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}]}),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
            ],
            "max_completion_tokens": 9,
            "n": 2,
        },
    ),
]


@pytest.mark.parametrize("path, body", BODIES)
def test_the_router_charges_what_a_replica_s_limiter_charges(llm, path, body):
    # a burst of one token refuses everything, and the 429 says how much was asked
    with run_server(llm, port=0, rate_limiter=limiter(1)) as server:
        with run_router([server.url], rate_limiter=limiter(1), max_model_len=MAX_MODEL_LEN) as rt:
            by_router = httpx.post(rt.url + path, json=body, timeout=60)
            by_server = httpx.post(server.url + path, json=body, timeout=60)
    assert by_router.status_code == by_server.status_code == 429
    asked = [
        int(re.search(r"Requested (\d+)", r.json()["error"]["message"]).group(1))
        for r in (by_router, by_server)
    ]
    assert asked[0] == asked[1] > 1
    assert by_router.json() == by_server.json()

    def quota_headers(r):
        return {k: v for k, v in r.headers.items() if k.startswith("x-ratelimit-")}

    assert quota_headers(by_router) == quota_headers(by_server) != {}


def test_bad_bodies_get_the_replica_s_400_and_cost_nothing(llm, reference_llm):
    quota = limiter(1000)
    with deployment(llm, reference_llm, quota, api_key=None) as (router, _):
        for raw, path, param in [
            (b"{not json", "/v1/completions", None),
            (json.dumps({"max_tokens": 5}).encode(), "/v1/completions", "prompt"),
            (json.dumps({"prompt": []}).encode(), "/v1/completions", "prompt"),
            (json.dumps({"messages": []}).encode(), "/v1/chat/completions", "messages"),
            (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "/v1/completions", None),
        ]:
            headers = {"content-type": "application/json"}
            r = httpx.post(router.url + path, content=raw, headers=headers, timeout=60)
            settled(router)
            assert r.status_code == 400, raw
            if param is not None:
                assert r.json()["error"]["param"] == param
            assert quota.remaining("") == 1000
        ok = post(router, {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200
        assert quota.remaining("") == 1000 - ok.json()["usage"]["total_tokens"]


def test_a_failed_upstream_gives_everything_back(llm):
    from tests.serve.test_router import free_port_url

    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    cost = num_tokens(llm, PROMPT) + 4
    quota = limiter(1000)
    with run_router([free_port_url()], rate_limiter=quota, max_model_len=MAX_MODEL_LEN) as rt:
        assert post(rt, body).status_code == 503  # no replica: nothing was generated
    assert quota.remaining("") == 1000
    # a replica's own 429 behind the router: nothing generated, nothing kept
    with run_server(llm, port=0, rate_limiter=limiter(cost - 1)) as server:
        with run_router([server.url], rate_limiter=quota, max_model_len=MAX_MODEL_LEN) as rt:
            assert post(rt, body).status_code == 429
    assert quota.remaining("") == 1000


def test_a_stream_the_client_leaves_keeps_only_what_was_streamed(llm, reference_llm):
    num_prompt = num_tokens(llm, PROMPT)
    max_tokens = MAX_MODEL_LEN - num_prompt
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    quota = limiter(1000)
    with deployment(llm, reference_llm, quota, api_key=None) as (router, _):
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            read = 0
            for line in r.iter_lines():
                read += line.startswith("data: ")
                if read == 3:
                    break  # the client leaves
        settled(router)
        charged = 1000 - quota.remaining("")
    # at least the three chunks read (one token each at least), far from the whole reservation
    assert num_prompt + 3 <= charged < num_prompt + max_tokens


SSE = (
    b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    b'data: {"choices": [{"index": 0, "delta": {"content": "Hello"}}]}\n\n'
    b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
    b'data: {"choices": [{"index": 1, "text": " world"}]}\n\n'
    b"data: [DONE]\n\n"
)


@given(cuts=st.lists(st.integers(0, len(SSE)), max_size=8))
def test_the_usage_meter_reads_a_stream_cut_anywhere(llm, cuts):
    tokenizer = llm.engine.tokenizer

    def count(body: bytes, pieces: list[int]) -> int | None:
        meter = UsageMeter(tokenizer, streaming=True)
        bounds = [0, *sorted(pieces), len(body)]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            meter.feed(body[lo:hi])
        return meter.completion_tokens()

    hello = len(tokenizer.encode("Hello", add_special_tokens=False))
    world = len(tokenizer.encode(" world", add_special_tokens=False))
    # choice 0: two chunks carried tokens (the role chunk none); choice 1: one chunk
    assert count(SSE, cuts) == max(2, hello) + max(1, world)
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 17}}\n\n'
    assert count(SSE + usage, cuts) == 17


def test_router_quota_options_are_checked_and_on_the_command_line():
    from minillm.cli.main import build_parser

    with pytest.raises(ValueError, match="rate_limit_burst_tokens needs"):
        Router(["http://a:1"], rate_limit_burst_tokens=10)
    with pytest.raises(ValueError, match="tokenizer and max_model_len"):
        Router(["http://a:1"], tokenizer="minillm-stdlib-target")
    with pytest.raises(ValueError, match="downloads nothing"):
        Router(["http://a:1"], rate_limit_tokens_per_minute=60, tokenizer="org/not-local")
    router = Router(["http://a:1"], rate_limit_tokens_per_minute=600, rate_limit_burst_tokens=50)
    assert (router.rate_limiter.tokens_per_minute, router.rate_limiter.burst_tokens) == (600, 50)
    # what serve defaults to: the model's limit, at most 4096
    config = json.loads((router.prompts.tokenizer.path.parent / "config.json").read_text())
    assert router.prompts.max_model_len == min(4096, config["max_position_embeddings"])
    argv = ["router", "--replica", "http://a:1", "--rate-limit-tokens-per-minute", "600"]
    args = build_parser("router").parse_args(
        [*argv, "--rate-limit-burst-tokens", "50", "--tokenizer", "m", "--max-model-len", "256"]
    )
    assert (args.rate_limit_tokens_per_minute, args.rate_limit_burst_tokens) == (600.0, 50.0)
    assert (args.tokenizer, args.max_model_len) == ("m", 256)
