"""Scheduling policies (fcfs, priority, sjf) and static batching: fixed cases, properties of the
scheduler with a fake model runner, and the engine's outputs on a tiny random Llama, which no
policy may change."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import GREEDY, PROMPTS, expected, finish, make_engine
from test_scheduler import make_request, plan, sample_all, step
from tiny_llama import build_tiny_llama, greedy_reference

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.scheduler import Scheduler, remaining_work_tokens
from minillm.engine.args import EngineArgs
from minillm.llm import LLM
from minillm.model.loader import load_model
from minillm.sampling_params import SamplingParams


def make_scheduler(policy="fcfs", batching="continuous", num_blocks=64, block_size=4, **kwargs):
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    options = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)
    options.update(kwargs)
    return Scheduler(
        manager,
        options["max_num_seqs"],
        options["max_num_batched_tokens"],
        options["max_model_len"],
        clock=lambda: 0.0,
        scheduling_policy=policy,
        batching_type=batching,
    )


def request(request_id, num_prompt_tokens, max_tokens=4, priority=0, arrival_time=0.0):
    r = make_request(request_id, num_prompt_tokens, max_tokens)
    r.priority = priority
    r.arrival_time = arrival_time
    return r


def ids(requests):
    return [r.request_id for r in requests]


def test_unknown_options_are_rejected():
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_scheduler(policy="lifo")
    with pytest.raises(ValueError, match="batching_type"):
        make_scheduler(batching="inflight")
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(scheduling_policy="random")
    with pytest.raises(ValueError, match="batching_type"):
        EngineArgs(batching_type="dynamic")


def test_fcfs_serves_in_arrival_order_with_preempted_requests_in_front():
    scheduler = make_scheduler()
    for r in (request("a", 4), request("b", 2), request("c", 8)):
        scheduler.add_request(r)
    assert ids(scheduler.waiting_order()) == ["a", "b", "c"]


def test_priority_serves_lower_values_first_and_ties_by_arrival():
    scheduler = make_scheduler("priority", max_num_seqs=2)
    scheduler.add_request(request("late-urgent", 4, priority=0, arrival_time=3.0))
    scheduler.add_request(request("early-low", 4, priority=5, arrival_time=0.0))
    scheduler.add_request(request("early-urgent", 4, priority=0, arrival_time=1.0))
    assert ids(scheduler.waiting_order()) == ["early-urgent", "late-urgent", "early-low"]
    assert plan(step(scheduler)) == [("early-urgent", 4, "prefill"), ("late-urgent", 4, "prefill")]


def test_sjf_serves_the_fewest_remaining_tokens_first():
    scheduler = make_scheduler("sjf", max_num_seqs=1, max_num_batched_tokens=64)
    long, short, medium = request("long", 30, 8), request("short", 3, 2), request("medium", 6, 8)
    for r in (long, short, medium):
        scheduler.add_request(r)
    assert [remaining_work_tokens(r, 64) for r in (long, short, medium)] == [38, 5, 14]
    assert ids(scheduler.waiting_order()) == ["short", "medium", "long"]
    assert plan(step(scheduler)) == [("short", 3, "prefill")]


def test_remaining_work_counts_recompute_after_preemption_and_caps_at_max_model_len():
    r = request("a", 10, max_tokens=6)
    for token_id in (7, 7):
        r.append_output_token(token_id, None)
    r.num_computed_tokens = 11
    assert remaining_work_tokens(r, 64) == 1 + 4
    r.num_computed_tokens = 0  # preempted: prompt and outputs are recomputed
    assert remaining_work_tokens(r, 64) == 12 + 4
    unbounded = make_request("b", 10, max_tokens=None)
    assert remaining_work_tokens(unbounded, 64) == 10 + 54


def test_priority_preemption_takes_the_lowest_priority_even_if_already_planned():
    # 4 blocks of 4 slots. "low" (priority 9) runs first, "high" (priority 0) joins; when
    # "high" needs a third block, "low" is preempted although it was planned first this step.
    scheduler = make_scheduler("priority", num_blocks=4, max_num_batched_tokens=64)
    low = request("low", 7, max_tokens=4, priority=9)
    scheduler.add_request(low)
    assert plan(step(scheduler)) == [("low", 7, "prefill")]
    high = request("high", 4, max_tokens=8, priority=0)
    scheduler.add_request(high)
    assert plan(step(scheduler)) == [("low", 1, "decode"), ("high", 4, "prefill")]
    # low holds 2 blocks, high 1 and one is free. Next step low's token 9 takes the free
    # block; high's token 5 then finds none, and the victim is low, planned first this step
    out = step(scheduler)
    assert out.preempted == [low]
    assert plan(out) == [("high", 1, "decode")]
    assert out.num_batched_tokens == 1  # low's planned token went back to the budget
    assert ids(scheduler.waiting) == ["low"]
    assert low.num_computed_tokens == 0 and low.output_token_ids == [7, 7]


def test_fcfs_preemption_still_takes_the_newest():
    scheduler = make_scheduler("fcfs", num_blocks=4, max_num_batched_tokens=64)
    a, b = request("a", 8, max_tokens=3), request("b", 8, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    out = step(scheduler)
    assert out.preempted == [b]
    assert plan(out) == [("a", 1, "decode")]


def test_static_batching_admits_nobody_until_the_whole_batch_is_done():
    scheduler = make_scheduler(batching="static", max_num_seqs=2, max_num_batched_tokens=64)
    for name, max_tokens in (("a", 1), ("b", 3), ("c", 1)):
        scheduler.add_request(request(name, 2, max_tokens=max_tokens))
    plans = []
    while scheduler.has_unfinished_requests():
        plans.append(plan(step(scheduler)))
    assert plans == [
        [("a", 2, "prefill"), ("b", 2, "prefill")],  # a finishes here (max_tokens=1)
        [("b", 1, "decode")],  # a's seat stays empty: c waits for the batch to end
        [("b", 1, "decode")],
        [("c", 2, "prefill")],
    ]


def test_continuous_batching_refills_the_seat_at_once():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for name, max_tokens in (("a", 1), ("b", 3), ("c", 1)):
        scheduler.add_request(request(name, 2, max_tokens=max_tokens))
    plans = [plan(step(scheduler)) for _ in range(2)]
    assert plans[1] == [("b", 1, "decode"), ("c", 2, "prefill")]


def test_a_static_batch_chunks_its_prompts_over_steps_but_takes_no_newcomer():
    scheduler = make_scheduler(batching="static", max_num_seqs=2, max_num_batched_tokens=6)
    scheduler.add_request(request("a", 5, max_tokens=2))
    scheduler.add_request(request("b", 5, max_tokens=2))
    assert plan(step(scheduler)) == [("a", 5, "prefill"), ("b", 1, "prefill")]
    scheduler.add_request(request("c", 1, max_tokens=1))  # arrives while the batch forms
    assert plan(step(scheduler)) == [("a", 1, "decode"), ("b", 4, "prefill")]
    assert plan(step(scheduler)) == [("b", 1, "decode")]  # a finished; c still waits
    assert plan(step(scheduler)) == [("c", 1, "prefill")]


def test_trace_records_the_waiting_queue_length():
    scheduler = make_scheduler(max_num_seqs=1)
    for name in "abc":
        scheduler.add_request(request(name, 2, max_tokens=1))
    traces = []
    while scheduler.has_unfinished_requests():
        traces.append(step(scheduler).trace())
    assert [t.num_waiting for t in traces] == [2, 1, 0]


# ---- properties: random request mixes, arrivals over time, every policy ----

arrival_specs = st.lists(
    st.tuples(
        st.integers(0, 6),  # arrival step
        st.integers(1, 20),  # prompt tokens
        st.integers(1, 6),  # max_tokens
        st.integers(0, 3),  # priority
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(
    specs=arrival_specs,
    policy=st.sampled_from(["fcfs", "priority", "sjf"]),
    batching=st.sampled_from(["continuous", "static"]),
    budget=st.integers(2, 24),
    max_num_seqs=st.integers(1, 4),
    num_blocks=st.integers(6, 20),
)
def test_every_request_finishes_within_the_budget_under_every_policy(
    specs, policy, batching, budget, max_num_seqs, num_blocks
):
    max_model_len = 24  # 6 blocks of 4: one sequence always fits the smallest pool
    scheduler = make_scheduler(
        policy,
        batching,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
    )
    requests = [
        (arrival, request(f"r{i}", prompt, max_tokens, priority, arrival_time=float(arrival)))
        for i, (arrival, prompt, max_tokens, priority) in enumerate(specs)
    ]
    num_steps = 0
    while num_steps <= max(a for a, _ in requests) or scheduler.has_unfinished_requests():
        for arrival, r in requests:
            if arrival == num_steps:
                scheduler.add_request(r)
        output = scheduler.schedule()
        assert output.num_batched_tokens <= budget
        assert scheduler.num_running_seqs <= max_num_seqs
        assert len({s.request.request_id for s in output.scheduled}) == len(output.scheduled)
        if batching == "static":
            # nobody outside the batch runs
            assert {s.request.request_id for s in output.scheduled} <= scheduler.static_batch
        scheduler.update_from_output(output, sample_all(output))
        num_steps += 1
        assert num_steps < 500, "requests never finish"
    for _, r in requests:
        assert r.is_finished
        assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens == max_model_len
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


# ---- the engine: no policy changes what greedy decoding produces ----


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model_dir):
    model = load_model(model_dir).model
    cache = {}

    def run(prompt):
        if prompt not in cache:
            cache[prompt] = greedy_reference(model, list(prompt), GREEDY.max_tokens)
        return cache[prompt]

    return run


@pytest.mark.parametrize(
    "options",
    [
        dict(scheduling_policy="priority"),
        dict(scheduling_policy="sjf", max_num_seqs=2, max_num_batched_tokens=16),
        dict(batching_type="static", max_num_seqs=3),
        dict(scheduling_policy="priority", num_gpu_blocks=9, max_num_batched_tokens=16),
    ],
    ids=["priority", "sjf-chunked", "static", "priority-preempting"],
)
def test_outputs_do_not_depend_on_the_policy(model_dir, reference, options):
    engine = make_engine(model_dir, block_size=16, **options)
    policy = engine.scheduler.scheduling_policy
    for i, prompt in enumerate(PROMPTS):
        priority = (len(PROMPTS) - i) % 3 if policy == "priority" else 0
        engine.add_request(str(i), prompt, GREEDY, priority=priority)
    assert finish(engine) == expected(reference, PROMPTS)
    if "num_gpu_blocks" in options:
        assert engine.stats.num_preemptions > 0


def test_priority_needs_the_priority_policy(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        engine.add_request("a", [5, 6], GREEDY, priority=1)
    assert not engine.has_unfinished_requests()


def test_llm_generate_passes_priorities(model_dir):
    llm = LLM(
        str(model_dir),
        device="cpu",
        max_model_len=64,
        max_num_seqs=1,
        num_gpu_blocks=8,
        scheduling_policy="priority",
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outputs = llm.generate([[5, 6], [7, 8], [9, 10]], params, use_tqdm=False, priority=[2, 0, 1])
    # one seat: the requests run one after another, most urgent first
    first_token_times = [o.metrics.first_token_time for o in outputs]
    assert sorted(range(3), key=lambda i: first_token_times[i]) == [1, 2, 0]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([[5, 6]], params, use_tqdm=False, priority=[0, 1])
