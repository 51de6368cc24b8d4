"""Token quotas: the bucket against a tick-by-tick simulation, and the server under a burst.

The simulation shares no code with TokenBucket: integer ticks, an integer refill per tick
capped at the burst, arrivals served in order. With integer rates and times the bucket's
float arithmetic is exact, so the two must admit exactly the same requests.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.serve import rate_limit, run_server
from minillm.serve.rate_limit import RateLimited, RateLimiter, TokenBucket
from tests.serve.conftest import greedy


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def simulate(rate: int, burst: int, arrivals: list[tuple[int, int]]):
    """Brute force: the level tick by tick. Returns (admitted flags, level at the start of
    each tick before its arrivals, whole ticks a refused request would have to wait)."""
    horizon = max((t for t, _ in arrivals), default=0)
    level, start_levels = burst, []
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    flags = [False] * len(arrivals)
    wait_of = [None] * len(arrivals)
    j = 0
    for tick in range(horizon + 1):
        if tick > 0:
            level = min(burst, level + rate)
        start_levels.append(level)
        while j < len(pending) and arrivals[pending[j]][0] == tick:
            i = pending[j]
            cost = arrivals[i][1]
            if cost <= level:
                flags[i] = True
                level -= cost
            elif cost <= burst:  # count the ticks until it would fit, nothing else taken
                k, probe = 0, level
                while probe < cost:
                    k, probe = k + 1, min(burst, probe + rate)
                wait_of[i] = k
            j += 1
    return flags, start_levels, wait_of


arrival_lists = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 40)), min_size=1, max_size=25
).map(lambda xs: sorted(xs, key=lambda a: a[0]))


@given(rate=st.integers(1, 12), burst=st.integers(1, 60), arrivals=arrival_lists)
def test_bucket_admits_exactly_what_the_simulation_admits(rate, burst, arrivals):
    clock = FakeClock()
    bucket = TokenBucket(rate, burst, clock)
    flags, _, wait_of = simulate(rate, burst, arrivals)
    for i, (tick, cost) in enumerate(arrivals):
        clock.now = tick
        wait = bucket.try_take(cost)
        assert (wait == 0.0) == flags[i], (i, tick, cost)
        if not flags[i]:
            if wait_of[i] is None:
                assert math.isinf(wait) and cost > burst
            else:  # the honest Retry-After: whole ticks until the request fits
                assert math.ceil(wait - 1e-9) == wait_of[i]


@given(rate=st.integers(1, 12), burst=st.integers(1, 60), arrivals=arrival_lists)
def test_no_window_from_a_full_bucket_admits_more_than_burst_plus_rate_times_t(
    rate, burst, arrivals
):
    clock = FakeClock()
    bucket = TokenBucket(rate, burst, clock)
    taken = {}
    for tick, cost in arrivals:
        clock.now = tick
        if bucket.try_take(cost) == 0.0:
            taken[tick] = taken.get(tick, 0) + cost
    _, start_levels, _ = simulate(rate, burst, arrivals)
    for a, level in enumerate(start_levels):
        if level != burst:
            continue
        for b in range(a, len(start_levels)):
            spent = sum(v for t, v in taken.items() if a <= t <= b)
            assert spent <= burst + rate * (b - a)


def test_refunds_the_unused_part_and_never_overfills():
    clock = FakeClock()
    limiter = RateLimiter(tokens_per_minute=60, burst_tokens=100, clock=clock)
    reservation = limiter.acquire("k", 70)
    assert limiter.remaining("k") == 30
    reservation.settle(25)  # used 25 of 70: 45 come back
    assert limiter.remaining("k") == 75
    reservation.settle(0)  # settling twice gives nothing more
    assert limiter.remaining("k") == 75
    clock.now = 10.0  # 1 token/s: 10 more
    assert limiter.remaining("k") == 85
    limiter.acquire("k", 80).settle(0)
    assert limiter.remaining("k") == 85
    clock.now = 1000.0
    assert limiter.remaining("k") == 100  # capped at the burst


def test_many_busy_keys_drop_full_buckets_rarely_and_keep_busy_ones(monkeypatch):
    """Past the bucket limit, full buckets go and busy ones stay; a scan happens only when
    the buckets left have doubled, so that 10,000 busy keys do not make every new key scan
    them all (as a limit that rescans at every new key did)."""
    monkeypatch.setattr(rate_limit, "MAX_IDLE_BUCKETS", 8)
    now = [0.0]
    limiter = RateLimiter(60.0, 10.0, clock=lambda: now[0])  # 1 token a second
    scans = []
    real_level = TokenBucket.level

    def counted(bucket):
        scans.append(bucket)
        return real_level.fget(bucket)

    monkeypatch.setattr(TokenBucket, "level", property(counted))
    for i in range(4):  # four idle keys: their buckets stay full
        limiter.remaining(f"idle{i}")
    for i in range(4):  # four busy ones: each takes 5 of its 10 tokens
        limiter.acquire(f"busy{i}", 5)
    scans.clear()
    limiter.acquire("busy4", 5)  # the ninth key: one scan drops the four full buckets
    assert sorted(limiter.buckets) == [f"busy{i}" for i in range(5)]
    assert len(scans) == 8 + 1  # the scan's reads, then the take's
    scans.clear()
    for i in range(5, 8):  # up to 8 buckets again: no scan
        limiter.acquire(f"busy{i}", 5)
    assert len(scans) == 3
    scans.clear()
    limiter.acquire("busy8", 5)  # 8 busy buckets: a scan that drops none, then none till 16
    assert len(limiter.buckets) == 9 and limiter.prune_at == 16
    scans.clear()
    for i in range(9, 16):
        limiter.acquire(f"busy{i}", 5)
    assert len(scans) == 7  # one level read per take, none of a scan
    now[0] = 10.0  # every bucket has refilled: the next new key's scan drops them all
    limiter.acquire("late", 5)
    assert sorted(limiter.buckets) == ["late"] and limiter.prune_at == 8


def test_keys_have_their_own_buckets_and_errors_name_the_field():
    limiter = RateLimiter(tokens_per_minute=600, burst_tokens=50, clock=FakeClock())
    limiter.acquire("a", 50)
    with pytest.raises(RateLimited) as refused:
        limiter.acquire("a", 1)
    assert refused.value.retry_after_s == 1  # 10 tokens/s: 0.1 s, rounded up to 1
    limiter.acquire("b", 50)  # another key is untouched
    with pytest.raises(RateLimited) as too_large:
        limiter.acquire("c", 51)
    assert too_large.value.retry_after_s is None
    with pytest.raises(ValueError, match="rate_limit_tokens_per_minute"):
        RateLimiter(0)
    with pytest.raises(ValueError, match="rate_limit_burst_tokens"):
        RateLimiter(60, burst_tokens=-1)


# ---------------------------------------------------------------------- the live server

PROMPT = "The capital of France is"
MAX_TOKENS = 4


def body(**extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, **extra}


def test_burst_gets_the_right_number_of_200s_and_429s_and_an_honest_retry_after(llm):
    cost = len(llm.engine.tokenizer.encode(PROMPT)) + MAX_TOKENS
    clock = FakeClock()
    # 60 tokens per minute: one token a second; room for 3 requests and half of a fourth
    limiter = RateLimiter(60, burst_tokens=3 * cost + cost // 2, clock=clock)
    with run_server(llm, port=0, rate_limiter=limiter, api_key=["tenant-a", "b"]) as server:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(
                    *(
                        client.post(
                            "/v1/completions",
                            json=body(ignore_eos=True),
                            headers={"Authorization": "Bearer tenant-a"},
                        )
                        for _ in range(6)
                    )
                )

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] * 3 + [429] * 3
        refused = next(r for r in responses if r.status_code == 429)
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        missing = cost - cost // 2  # tokens short after three admissions, refilled at 1/s
        assert int(refused.headers["Retry-After"]) == missing
        assert refused.headers["x-ratelimit-remaining-tokens"] == str(cost // 2)
        for ok in (r for r in responses if r.status_code == 200):
            assert ok.json()["usage"]["completion_tokens"] == MAX_TOKENS  # no refund due

        other = httpx.post(
            server.url + "/v1/completions", json=body(), headers={"Authorization": "Bearer b"}
        )
        assert other.status_code == 200  # another key has its own bucket

        def retry() -> httpx.Response:
            headers = {"Authorization": "Bearer tenant-a"}
            return httpx.post(server.url + "/v1/completions", json=body(), headers=headers)

        clock.now = missing - 1  # a second early: still refused
        assert retry().status_code == 429
        clock.now = missing  # as told: admitted
        assert retry().status_code == 200

        too_large = httpx.post(
            server.url + "/v1/completions",
            json=body(max_tokens=200),
            headers={"Authorization": "Bearer b"},
        )
        assert too_large.status_code == 429 and "Retry-After" not in too_large.headers


@pytest.mark.parametrize("stream", [False, True])
def test_unused_tokens_come_back_when_a_request_stops_early(llm, reference_llm, stream):
    text = greedy(reference_llm, [PROMPT], 20)[0]
    stop = text[len(text) // 4]  # a character early in the greedy output
    ids = llm.engine.tokenizer.encode(PROMPT)
    limiter = RateLimiter(60, burst_tokens=1000, clock=FakeClock())
    request = body(max_tokens=20, stop=[stop], stream=stream)
    if stream:
        request["stream_options"] = {"include_usage": True}
    with run_server(llm, port=0, rate_limiter=limiter) as server:
        response = httpx.post(server.url + "/v1/completions", json=request, timeout=60)
        assert response.status_code == 200
        if stream:
            events = [line[6:] for line in response.text.splitlines() if line[6:]]
            usage = json.loads(events[-2])["usage"]
        else:
            usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["completion_tokens"] < 20  # it stopped early: the premise of the test
    assert limiter.remaining("") == 1000 - usage["total_tokens"]


def test_serve_command_line_takes_the_rate_limit_options():
    from minillm.cli.main import build_parser
    from minillm.serve import make_server_app

    args = build_parser("serve").parse_args(
        ["serve", "--rate-limit-tokens-per-minute", "600", "--rate-limit-burst-tokens", "50"]
    )
    assert (args.rate_limit_tokens_per_minute, args.rate_limit_burst_tokens) == (600.0, 50.0)
    with pytest.raises(ValueError, match="rate_limit_tokens_per_minute"):
        make_server_app("no-such-model", rate_limit_burst_tokens=10)


def test_without_api_keys_every_client_shares_one_bucket(llm):
    """A bearer token nobody checks cannot buy a fresh bucket: made-up keys draw on one."""
    cost = len(llm.engine.tokenizer.encode(PROMPT)) + MAX_TOKENS
    limiter = RateLimiter(60, burst_tokens=2 * cost, clock=FakeClock())
    with run_server(llm, port=0, rate_limiter=limiter) as server:
        codes = [
            httpx.post(
                server.url + "/v1/completions",
                json=body(ignore_eos=True),
                headers={"Authorization": f"Bearer made-up-{i}"},
            ).status_code
            for i in range(4)
        ]
    assert codes == [200, 200, 429, 429]


def test_each_of_several_api_keys_has_its_own_bucket_and_others_are_refused(llm):
    cost = len(llm.engine.tokenizer.encode(PROMPT)) + MAX_TOKENS
    limiter = RateLimiter(60, burst_tokens=cost, clock=FakeClock())
    with run_server(llm, port=0, rate_limiter=limiter, api_key=["k1", "k2"]) as server:

        def post(key: str) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            url = server.url + "/v1/completions"
            return httpx.post(url, json=body(ignore_eos=True), headers=headers).status_code

        assert [post("k1"), post("k1"), post("k2"), post("k2"), post("k3")] == [
            200,
            429,
            200,
            429,
            401,
        ]
