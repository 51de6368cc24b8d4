"""The model-free schedule: it must be the schedule the real engine runs.

Oracles: the engine itself on a tiny random Llama (same options, same requests), and, for the
case without chunking, a seat-counting model of continuous batching written from its definition.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_llama import build_tiny_llama

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.schedule_sim import ScheduleSim, SimRequest, simulate_schedule
from minillm.sampling_params import SamplingParams

requests_strategy = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=6
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def seat_oracle(num_output_tokens: list[int], max_num_seqs: int) -> list[int]:
    """Finish steps when every prompt fits the budget: a request admitted in step s holds a
    seat through step s + n - 1; a seat freed in step t is taken again in step t + 1."""
    seats_free_at = [0] * max_num_seqs  # the first step at which each seat is free
    finish = []
    for n in num_output_tokens:  # first come, first served
        seat = min(range(max_num_seqs), key=lambda s: seats_free_at[s])
        start = seats_free_at[seat]
        finish.append(start + n - 1)
        seats_free_at[seat] = start + n
    return finish


def test_a_worked_example():
    sim = simulate_schedule([(5, 3), (4, 2), (6, 4), (3, 1)], max_num_seqs=2)
    assert isinstance(sim, ScheduleSim)
    assert [t.scheduled for t in sim.traces] == [
        [("0", 5, "prefill"), ("1", 4, "prefill")],
        [("0", 1, "decode"), ("1", 1, "decode")],
        [("0", 1, "decode"), ("2", 6, "prefill")],  # "1" finished in step 1: "2" takes its seat
        [("2", 1, "decode"), ("3", 3, "prefill")],
        [("2", 1, "decode")],
        [("2", 1, "decode")],
    ]
    assert sim.finish_steps == [2, 1, 5, 3]
    assert sim.num_steps == 6


def test_chunked_prefill_splits_the_prompt_over_steps():
    sim = simulate_schedule([SimRequest(20, 2)], max_num_seqs=4, max_num_batched_tokens=8)
    assert [t.scheduled for t in sim.traces] == [
        [("0", 8, "prefill")],
        [("0", 8, "prefill")],
        [("0", 4, "prefill")],
        [("0", 1, "decode")],
    ]
    assert sim.finish_steps == [3]


def test_a_small_cache_preempts():
    # 4 blocks of 4 tokens: two requests growing to 12 tokens each cannot both stay
    sim = simulate_schedule([(4, 8), (4, 8)], max_num_seqs=2, block_size=4, num_blocks=4)
    assert any(t.preempted for t in sim.traces)
    assert all(step >= 0 for step in sim.finish_steps)


def test_bad_requests_are_rejected():
    with pytest.raises(ValueError, match="at least one prompt token"):
        SimRequest(0, 3)
    with pytest.raises(ValueError, match="at least one prompt token"):
        simulate_schedule([(3, 0)], max_num_seqs=1)


@settings(max_examples=40, deadline=None)
@given(requests_strategy, st.integers(1, 4))
def test_matches_the_seat_oracle_without_chunking(requests, max_num_seqs):
    sim = simulate_schedule(requests, max_num_seqs=max_num_seqs)
    expected = seat_oracle([n for _, n in requests], max_num_seqs)
    assert sim.finish_steps == expected
    assert sim.num_steps == max(expected) + 1


NUM_BLOCKS = 64  # room for every request at once: neither side preempts


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    requests=requests_strategy,
    max_num_seqs=st.integers(1, 4),
    budget=st.sampled_from([8, 24, 2048]),
    block_size=st.sampled_from([4, 16]),
)
def test_matches_the_engine(model_dir, requests, max_num_seqs, budget, block_size):
    sim = simulate_schedule(
        requests,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_blocks=NUM_BLOCKS,
    )
    engine = LLMEngine(
        EngineArgs(
            model=model_dir,
            device="cpu",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            block_size=block_size,
            max_model_len=64,
            num_gpu_blocks=NUM_BLOCKS,
            enable_prefix_caching=False,
        )
    )
    for i, (num_prompt, num_output) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=num_output, ignore_eos=True)
        engine.add_request(str(i), [3 + (i + j) % 200 for j in range(num_prompt)], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert [t.scheduled for t in engine.stats.trace] == [t.scheduled for t in sim.traces]


# ---- arrivals over time, policies and static batching ----


def test_late_arrivals_leave_idle_steps_and_record_first_tokens():
    sim = simulate_schedule([SimRequest(2, 2), SimRequest(3, 1, arrival_step=4)], max_num_seqs=2)
    assert [t.scheduled for t in sim.traces] == [
        [("0", 2, "prefill")],
        [("0", 1, "decode")],
        [],
        [],
        [("1", 3, "prefill")],
    ]
    assert sim.first_token_steps == [0, 4]
    assert sim.finish_steps == [1, 4]


def test_the_worked_budget_example():
    # a 10-token budget and prompts of 3, 5 and 12 tokens arriving together
    sim = simulate_schedule([(3, 6), (5, 6), (12, 6)], max_num_seqs=4, max_num_batched_tokens=10)
    assert [[n for _, n, _ in t.scheduled] for t in sim.traces[:4]] == [
        [3, 5, 2],
        [1, 1, 8],
        [1, 1, 2],
        [1, 1, 1],
    ]


@settings(max_examples=10, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 8), st.integers(0, 5), st.integers(0, 2)),
        min_size=1,
        max_size=5,
    ),
    policy=st.sampled_from(["fcfs", "priority", "sjf"]),
    batching=st.sampled_from(["continuous", "static"]),
    budget=st.sampled_from([8, 2048]),
)
def test_policies_and_arrivals_match_the_engine(model_dir, requests, policy, batching, budget):
    sims = [SimRequest(p, n, a, prio) for p, n, a, prio in requests]
    sim = simulate_schedule(
        sims,
        max_num_seqs=2,
        max_num_batched_tokens=budget,
        block_size=4,
        num_blocks=NUM_BLOCKS,
        scheduling_policy=policy,
        batching_type=batching,
    )
    engine = LLMEngine(
        EngineArgs(
            model=model_dir,
            device="cpu",
            max_num_seqs=2,
            max_num_batched_tokens=budget,
            block_size=4,
            max_model_len=64,
            num_gpu_blocks=NUM_BLOCKS,
            enable_prefix_caching=False,
            scheduling_policy=policy,
            batching_type=batching,
        )
    )
    pending = sorted(range(len(sims)), key=lambda i: sims[i].arrival_step)
    while pending or engine.has_unfinished_requests():
        while pending and sims[pending[0]].arrival_step <= engine.stats.num_steps:
            i = pending.pop(0)
            params = SamplingParams(
                temperature=0.0, max_tokens=sims[i].num_output_tokens, ignore_eos=True
            )
            prompt = [3 + (i + j) % 200 for j in range(sims[i].num_prompt_tokens)]
            priority = sims[i].priority if policy == "priority" else 0
            engine.add_request(
                str(i), prompt, params, arrival_time=float(sims[i].arrival_step), priority=priority
            )
        engine.step()
    assert [t.scheduled for t in engine.stats.trace] == [t.scheduled for t in sim.traces]
