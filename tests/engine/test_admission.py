"""Admission rules of vLLM, SGLang and TensorRT-LLM on one pool: each one-shot decision against a
brute-force search over queue prefixes, fixed cases of eviction, and properties of whole runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.lab.admission import (
    SGLANG_INIT_NEW_TOKEN_RATIO,
    PoolEntry,
    PoolRequest,
    admit_sglang,
    admit_trtllm,
    admit_vllm,
    admitted_at_start,
    eviction_victim,
    sglang_min_new_token_ratio,
    simulate_pool,
)


def entry(request_id, prompt, max_tokens, generated=0, output=None):
    output = max_tokens if output is None else output
    return PoolEntry(PoolRequest(request_id, prompt, max_tokens, output), generated)


def longest_prefix(waiting, fits):
    """Brute force: the longest k such that fits(waiting[:k]) holds for k and every shorter k."""
    best = 0
    for k in range(1, len(waiting) + 1):
        if not fits(waiting[:k]):
            break
        best = k
    return [e.request.request_id for e in waiting[:best]]


entries = st.builds(
    lambda p, m, g: entry("x", p, m, min(g, m - 1)),
    st.integers(1, 300),
    st.integers(1, 300),
    st.integers(0, 300),
)


def numbered(es):
    return [PoolEntry(PoolRequest(str(i), *astuple(e)), e.num_generated) for i, e in enumerate(es)]


def astuple(e):
    r = e.request
    return r.num_prompt_tokens, r.max_tokens, r.num_output_tokens


@settings(max_examples=200)
@given(st.lists(entries, max_size=8), st.lists(entries, max_size=4), st.integers(0, 3000))
def test_vllm_admits_the_longest_prefix_whose_tokens_fit(waiting, running, capacity):
    waiting, running = numbered(waiting), numbered(running)
    free = capacity - sum(e.request.num_prompt_tokens + e.num_generated for e in running)
    expected = longest_prefix(
        waiting, lambda prefix: sum(e.num_tokens_to_compute for e in prefix) <= free
    )
    assert admit_vllm(waiting, running, capacity) == expected


@settings(max_examples=200)
@given(st.lists(entries, max_size=8), st.lists(entries, max_size=4), st.integers(0, 3000))
def test_trtllm_admits_the_longest_prefix_whose_reservations_fit(waiting, running, capacity):
    waiting, running = numbered(waiting), numbered(running)

    def reserved(es):
        return sum(e.request.num_prompt_tokens + e.request.max_tokens for e in es)

    expected = longest_prefix(
        waiting, lambda prefix: reserved(running) + reserved(prefix) <= capacity
    )
    assert admit_trtllm(waiting, running, capacity) == expected


@settings(max_examples=200)
@given(
    st.lists(entries, max_size=8),
    st.lists(entries, max_size=4),
    st.integers(0, 3000),
    st.sampled_from([0.1, 0.5, 0.7, 1.0]),
    st.sampled_from([50, 4096]),
)
def test_sglang_admits_while_the_forecast_leaves_room(waiting, running, capacity, ratio, clip):
    waiting, running = numbered(waiting), numbered(running)
    free = capacity - sum(e.request.num_prompt_tokens + e.num_generated for e in running)
    forecast = ratio * sum(min(e.request.max_tokens - e.num_generated, clip) for e in running)

    def booking(e):
        return e.num_tokens_to_compute + min(e.request.max_tokens - e.num_generated, clip)

    def fits(prefix):
        # the last request of the prefix is checked against what the earlier ones left
        *earlier, last = prefix
        return booking(last) < free - forecast - sum(booking(e) for e in earlier)

    expected = longest_prefix(waiting, fits)
    assert admit_sglang(waiting, running, capacity, ratio, clip) == expected


def test_one_pool_three_answers():
    # 8 requests of 100 prompt tokens and max_tokens 200 on an empty pool of 1,200 slots
    requests = [PoolRequest(str(i), 100, 200, 50) for i in range(8)]
    assert admitted_at_start("vllm", requests, 1200) == 8  # 800 prompt tokens fit
    assert admitted_at_start("trtllm", requests, 1200) == 4  # 4 x 300 reserved
    assert admitted_at_start("sglang", requests, 1200) == 3  # 300 < 1200 - 900 fails for the 4th
    with pytest.raises(ValueError, match="policy"):
        admitted_at_start("tgi", requests, 1200)


def test_sglang_counts_running_requests_at_the_forecast_ratio():
    running = [entry("a", 100, 200, generated=50)]  # holds 150, may write 150 more
    waiting = [entry("b", 100, 200)]
    # free 850; forecast 0.7 * 150 = 105; b books 300 < 745
    assert admit_sglang(waiting, running, 1000, 0.7) == ["b"]
    # with the whole remainder reserved (ratio 1), 300 < 700 still fits; a pool of 600 does not
    assert admit_sglang(waiting, running, 600, 1.0) == []
    assert admit_sglang(waiting, running, 600, 0.1) == ["b"]  # 300 < 450 - 15


def test_vllm_preempts_the_newest_and_requeues_it_in_front():
    # a (admitted first) and b both grow; the pool of 30 slots runs out at step 5
    requests = [PoolRequest("a", 10, 12, 12), PoolRequest("b", 10, 12, 12)]
    run = simulate_pool("vllm", requests, 30)
    first = next(s for s in run.steps if s.evicted)
    assert first.evicted == ["b"]
    assert first.running == ["a"]
    assert run.finish_steps["a"] < run.finish_steps["b"]
    assert run.num_recomputed_tokens > 0


def test_sglang_retracts_the_request_with_the_fewest_outputs():
    # c joins later and has the fewest outputs when the pool runs out
    requests = [
        PoolRequest("a", 10, 40, 40),
        PoolRequest("b", 10, 40, 40),
        PoolRequest("c", 5, 40, 40),
    ]
    run = simulate_pool("sglang", requests, 60, new_token_ratio=0.0)
    evictions = [s for s in run.steps if s.evicted]
    assert evictions, "the pool must run out"
    step = evictions[0]
    before = run.steps[step.step - 1].running
    assert "c" in before and step.evicted[0] == "c"
    assert step.new_token_ratio > 0.0  # re-estimated after the retraction


def test_eviction_victims():
    running = [entry("old", 10, 50, 30), entry("mid", 40, 50, 5), entry("new", 20, 50, 5)]
    assert eviction_victim("vllm", running).request.request_id == "new"
    # fewest outputs (5), and of those the longest prompt (40)
    assert eviction_victim("sglang", running).request.request_id == "mid"
    with pytest.raises(ValueError, match="never evicts"):
        eviction_victim("trtllm", running)


def test_sglang_ratio_decays_to_its_floor_without_retraction():
    requests = [PoolRequest("a", 1, 700, 700)]
    run = simulate_pool("sglang", requests, 1000)
    ratios = [s.new_token_ratio for s in run.steps]
    assert ratios[0] < SGLANG_INIT_NEW_TOKEN_RATIO
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[-1] == pytest.approx(sglang_min_new_token_ratio())
    assert sglang_min_new_token_ratio() == pytest.approx(0.098)


def test_requests_larger_than_the_pool_are_rejected():
    with pytest.raises(ValueError, match="larger"):
        simulate_pool("vllm", [PoolRequest("a", 50, 50, 10)], 100)
    with pytest.raises(ValueError, match="num_output_tokens"):
        PoolRequest("a", 5, 3, 4)


workloads = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 40), st.floats(0.01, 1.0)),
    min_size=1,
    max_size=10,
)


@settings(max_examples=60, deadline=None)
@given(
    workload=workloads,
    policy=st.sampled_from(["vllm", "sglang", "trtllm"]),
    extra=st.integers(1, 200),
    max_num_seqs=st.one_of(st.none(), st.integers(1, 4)),
)
def test_every_request_finishes_and_the_pool_never_overflows(workload, policy, extra, max_num_seqs):
    requests = [
        PoolRequest(str(i), p, m, max(1, round(f * m))) for i, (p, m, f) in enumerate(workload)
    ]
    capacity = max(r.num_prompt_tokens + r.max_tokens for r in requests) + extra
    run = simulate_pool(policy, requests, capacity, max_num_seqs=max_num_seqs)
    assert set(run.finish_steps) == {r.request_id for r in requests}
    for step in run.steps:
        assert step.num_used_slots <= capacity
        assert max_num_seqs is None or len(step.running) <= max_num_seqs
    if policy == "trtllm":
        assert run.num_evictions == 0
    # a request runs exactly num_output_tokens steps, split over its stays in the pool
    for r in requests:
        steps_running = sum(r.request_id in s.running for s in run.steps)
        assert steps_running == r.num_output_tokens
