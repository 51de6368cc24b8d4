"""Scheduler tests: fixed cases of the policy, stop conditions, and stateful properties with a
real KVCacheManager and a fake model runner that samples random tokens."""

import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.request import Request, RequestStatus
from minillm.core.scheduler import Scheduler, check_stop
from minillm.outputs import SampledToken
from minillm.sampling_params import SamplingParams

EOS = 0


def make_request(request_id, num_prompt_tokens, max_tokens=4, n=1, first_token=1, **params):
    params = SamplingParams(n=n, max_tokens=max_tokens, **params)
    prompt = [first_token + i % 50 for i in range(num_prompt_tokens)]
    request = Request(request_id, prompt, params, arrival_time=0.0, eos_token_ids=frozenset({EOS}))
    request.pending_forks = [
        Request(f"{request_id}#{i}", prompt, params, arrival_time=0.0, index=i) for i in range(1, n)
    ]
    return request


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    budget=16,
    max_model_len=64,
    chunked=True,
    prefix=True,
):
    # prefix: True or "hash" for hashed blocks, "radix" for the radix tree, False for none
    algo = prefix if isinstance(prefix, str) else "hash"
    manager = KVCacheManager(num_blocks, block_size, bool(prefix), prefix_caching_algo=algo)
    max_num_seqs = min(max_num_seqs, budget)  # every seat needs a token each step (vLLM's rule)
    return Scheduler(manager, max_num_seqs, budget, max_model_len, chunked, clock=lambda: 0.0)


def sample_all(output, token_id=7, rng=None):
    """Fake model runner: a token for every sequence whose step samples (forks included)."""
    sampled = {}
    for scheduled in output.scheduled:
        for seq in scheduled.sampling_seqs:
            token = token_id if rng is None else rng.randrange(1, 100)
            sampled[seq.request_id] = SampledToken(token)
    return sampled


def step(scheduler, token_id=7):
    output = scheduler.schedule()
    scheduler.update_from_output(output, sample_all(output, token_id))
    return output


def plan(output):
    return [(s.request.request_id, s.num_new_tokens, s.phase) for s in output.scheduled]


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_on_the_last_chunk():
    scheduler = make_scheduler(budget=8)
    request = make_request("a", 20, max_tokens=2)
    scheduler.add_request(request)
    chunks = [step(scheduler) for _ in range(3)]
    assert [plan(c) for c in chunks] == [
        [("a", 8, "prefill")],
        [("a", 8, "prefill")],
        [("a", 4, "prefill")],
    ]
    assert [c.scheduled[0].samples for c in chunks] == [False, False, True]
    assert request.output_token_ids == [7]
    assert plan(step(scheduler)) == [("a", 1, "decode")]
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert not scheduler.has_unfinished_requests()


def test_running_requests_are_served_before_waiting_ones_get_the_rest_of_the_budget():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 3, max_tokens=10))
    assert plan(step(scheduler)) == [("a", 3, "prefill")]
    scheduler.add_request(make_request("b", 12))
    assert plan(step(scheduler)) == [("a", 1, "decode"), ("b", 7, "prefill")]
    assert plan(step(scheduler)) == [("a", 1, "decode"), ("b", 5, "prefill")]
    assert plan(step(scheduler)) == [("a", 1, "decode"), ("b", 1, "decode")]


def test_the_token_budget_is_shared_by_two_prompts_in_flight():
    scheduler = make_scheduler(budget=4)
    scheduler.add_request(make_request("a", 10, max_tokens=2))
    scheduler.add_request(make_request("b", 10, first_token=60))
    plans = [plan(step(scheduler)) for _ in range(4)]
    assert plans == [
        [("a", 4, "prefill")],
        [("a", 4, "prefill")],
        [("a", 2, "prefill"), ("b", 2, "prefill")],
        [("a", 1, "decode"), ("b", 3, "prefill")],
    ]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_the_budget_whole():
    plans = {}
    for chunked in (False, True):
        scheduler = make_scheduler(budget=32, max_model_len=32, chunked=chunked)
        scheduler.add_request(make_request("a", 30, max_tokens=2))
        scheduler.add_request(make_request("b", 10, first_token=60))
        plans[chunked] = [plan(step(scheduler)) for _ in range(2)]
    # without chunking b's 10 tokens wait for a step with room for all of them
    assert plans[False] == [[("a", 30, "prefill")], [("a", 1, "decode"), ("b", 10, "prefill")]]
    assert plans[True] == [
        [("a", 30, "prefill"), ("b", 2, "prefill")],
        [("a", 1, "decode"), ("b", 8, "prefill")],
    ]


def test_without_chunked_prefill_the_budget_must_hold_a_whole_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(budget=16, max_model_len=64, chunked=False)


def test_max_num_seqs_limits_the_batch_and_counts_pending_forks():
    scheduler = make_scheduler(max_num_seqs=3, budget=64)
    scheduler.add_request(make_request("a", 2, n=2))
    scheduler.add_request(make_request("b", 2))
    scheduler.add_request(make_request("c", 2))
    # a holds two seats (itself and its fork to come), b the third, c waits
    assert plan(step(scheduler)) == [("a", 2, "prefill"), ("b", 2, "prefill")]
    assert [r.request_id for r in scheduler.running] == ["a", "b", "a#1"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


@pytest.mark.parametrize("algo", ["hash", "radix"])
def test_prefix_cache_hit_skips_the_cached_blocks_of_a_new_request(algo):
    scheduler = make_scheduler(block_size=4, budget=64, prefix=algo)
    scheduler.add_request(make_request("a", 10, max_tokens=1))
    step(scheduler)  # a computes 10 tokens: blocks 0 and 1 are full and cached, then a finishes
    scheduler.add_request(make_request("b", 11, max_tokens=1))
    output = step(scheduler)
    assert plan(output) == [("b", 3, "prefill")]
    assert output.scheduled[0].num_computed_tokens == 8
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (21, 8)


def test_preemption_frees_the_newest_request_and_requeues_it_in_front():
    # 4 blocks of 4 slots; a and b each take 2 blocks with their prompts
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64, max_model_len=16)
    a = make_request("a", 8, max_tokens=3)
    b = make_request("b", 8, max_tokens=3)
    c = make_request("c", 2)
    for request in (a, b, c):
        scheduler.add_request(request)
    assert plan(step(scheduler)) == [("a", 8, "prefill"), ("b", 8, "prefill")]
    # a's decode token needs a third block: b, the newest, is preempted to make room
    output = step(scheduler)
    assert plan(output) == [("a", 1, "decode")]
    assert output.preempted == [b]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # kept, to be recomputed with the prompt
    assert list(scheduler.waiting) == [b, c]
    assert scheduler.num_preemptions == 1
    # b resumes: its 8 prompt tokens are still in the prefix cache, its output token is
    # recomputed; a finishes
    output = step(scheduler)
    assert [(s.request, s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled] == [
        (a, 9, 1),
        (b, 8, 1),
    ]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [7, 7]


def test_a_request_preempts_itself_when_it_is_the_newest():
    scheduler = make_scheduler(num_blocks=3, block_size=4, budget=64, max_model_len=12)
    a = make_request("a", 6, max_tokens=4)  # 2 blocks, room for 2 more tokens
    b = make_request("b", 4, max_tokens=4, first_token=60)  # 1 full block
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    # b's decode token needs a new block; b is the newest running request, so it yields
    output = step(scheduler)
    assert plan(output) == [("a", 1, "decode")]
    assert output.preempted == [b]
    assert list(scheduler.waiting) == [b]


def test_n_greater_than_one_forks_when_the_prompt_is_planned_and_shares_its_blocks():
    scheduler = make_scheduler(block_size=4, budget=64)
    parent = make_request("a", 6, n=3, max_tokens=2)
    forks = list(parent.pending_forks)
    scheduler.add_request(parent)
    manager = scheduler.kv_cache_manager
    output = scheduler.schedule()
    # the plan names the forks, and they already share every block of the parent
    [scheduled] = output.scheduled
    assert scheduled.forks == forks and scheduled.sampling_seqs == [parent, *forks]
    assert parent.pending_forks == []
    block_ids = manager.get_block_ids("a")
    assert scheduled.block_ids == block_ids
    assert all(manager.get_block_ids(f.request_id) == block_ids for f in forks)
    assert [manager.block_pool.blocks[i].ref_cnt for i in block_ids] == [3, 3]
    sampled = {"a": SampledToken(5), "a#1": SampledToken(6), "a#2": SampledToken(7)}
    scheduler.update_from_output(output, sampled)
    assert [r.output_token_ids for r in (parent, *forks)] == [[5], [6], [7]]
    assert [r.num_computed_tokens for r in (parent, *forks)] == [6, 6, 6]
    # each decode writes position 6 into the shared second block: copy-on-write for two of
    # them, and the copies travel in the plan
    output = scheduler.schedule()
    assert plan(output) == [("a", 1, "decode"), ("a#1", 1, "decode"), ("a#2", 1, "decode")]
    assert len(output.block_copies) == 2
    assert all(src == block_ids[1] for src, _ in output.block_copies)
    assert [s.block_ids for s in output.scheduled] == [
        manager.get_block_ids(r.request_id) for r in (parent, *forks)
    ]
    assert manager.take_copy_on_write() == []


def test_static_batching_holds_with_forks():
    scheduler = make_scheduler(block_size=4, budget=64, max_num_seqs=4)
    scheduler.batching_type = "static"
    a, b = make_request("a", 6, n=2, max_tokens=3), make_request("b", 6, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    assert scheduler.static_batch == {"a", "a#1", "b"}
    late = make_request("late", 2, max_tokens=2)
    scheduler.add_request(late)
    while any(r.request_id != "late" for r in scheduler.running):
        assert "late" not in [s.request.request_id for s in step(scheduler).scheduled]
    assert [s.request.request_id for s in step(scheduler).scheduled] == ["late"]


def test_abort_finishes_waiting_and_running_requests_and_frees_their_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 5, n=2)
    fork = b.pending_forks[0]
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    scheduler.finish_requests(["a", "b", "gone"], RequestStatus.FINISHED_ABORTED)
    assert a.status is b.status is fork.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_trace_records_tokens_and_phase_per_request():
    scheduler = make_scheduler(budget=6)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4))
    step(scheduler)
    trace = step(scheduler).trace()
    assert trace.step == 1
    assert trace.scheduled == [("a", 1, "decode"), ("b", 2, "prefill")]
    assert trace.preempted == []


# ---- stop conditions: stop tokens and length (stop strings are the output processor's) ----


def feed(request, token_ids, max_model_len=100):
    """Append tokens one by one until check_stop finishes the request."""
    for token_id in token_ids:
        request.append_output_token(token_id, None)
        if check_stop(request, max_model_len):
            return True
    return False


def text_request(**params):
    params.setdefault("max_tokens", 20)
    return Request("r", [1, 2], SamplingParams(**params), 0.0, eos_token_ids=frozenset({EOS}))


def test_eos_stops_unless_ignored_or_before_min_tokens():
    request = text_request()
    assert feed(request, [ord("h"), EOS, ord("x")])
    assert (request.status, request.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    assert request.output_token_ids == [ord("h"), EOS]
    assert not feed(text_request(ignore_eos=True), [EOS, EOS])
    request = text_request(min_tokens=2)
    assert feed(request, [EOS, EOS])
    assert request.num_output_tokens == 2


def test_stop_token_ids_give_the_token_as_stop_reason():
    request = text_request(stop_token_ids=[ord("!")])
    assert feed(request, [ord(c) for c in "hi!"])
    assert (request.status, request.stop_reason) == (RequestStatus.FINISHED_STOPPED, ord("!"))


def test_stop_strings_are_not_the_schedulers_business():
    request = text_request(stop=["END"])
    assert not feed(request, [ord(c) for c in "abcENDdef"])
    assert request.status is RequestStatus.WAITING


def test_length_limits():
    request = text_request(max_tokens=3)
    assert feed(request, [ord("a")] * 5)
    assert (request.status, request.num_output_tokens) == (RequestStatus.FINISHED_LENGTH, 3)
    request = text_request(max_tokens=None)
    assert feed(request, [ord("a")] * 10, max_model_len=6)
    assert (request.status, request.num_tokens) == (RequestStatus.FINISHED_LENGTH, 6)


# ---- properties: a real KVCacheManager and a fake model runner ----


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps; after every step the scheduler's invariants hold."""

    @initialize(
        num_blocks=st.integers(8, 24),
        block_size=st.sampled_from([2, 4]),
        max_num_seqs=st.integers(1, 5),
        budget=st.integers(2, 16),
        chunked=st.booleans(),
        prefix=st.sampled_from([False, "hash", "radix"]),
        seed=st.integers(0, 2**16),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget, chunked, prefix, seed):
        self.max_model_len = 16
        if not chunked:
            budget = max(budget, self.max_model_len)
        self.scheduler = make_scheduler(
            num_blocks, block_size, max_num_seqs, budget, self.max_model_len, chunked, prefix
        )
        self.rng = random.Random(seed)
        self.requests = []
        self.last_output = None

    @rule(
        specs=st.lists(
            st.tuples(st.integers(1, 15), st.integers(1, 8), st.integers(1, 2), st.integers(1, 3)),
            min_size=1,
            max_size=3,
        )
    )
    def add(self, specs):
        """A burst of arrivals: (prompt length, max_tokens, n, first token) each."""
        for num_prompt_tokens, max_tokens, n, first_token in specs:
            n = min(n, self.scheduler.max_num_seqs)
            request = make_request(
                f"r{len(self.requests)}", num_prompt_tokens, max_tokens, n, first_token
            )
            self.requests.append(request)
            self.requests.extend(request.pending_forks)
            self.scheduler.add_request(request)

    @rule()
    def step(self):
        output = self.scheduler.schedule()
        self.check_plan(output)
        self.scheduler.update_from_output(output, sample_all(output, rng=self.rng))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        request = data.draw(st.sampled_from(self.requests))
        self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)

    def check_plan(self, output):
        scheduler = self.scheduler
        assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert scheduler.num_running_seqs <= scheduler.max_num_seqs
        ids = [s.request.request_id for s in output.scheduled]
        assert len(ids) == len(set(ids))
        manager = scheduler.kv_cache_manager
        for s in output.scheduled:
            assert s.num_new_tokens >= 1
            assert s.request.status is RequestStatus.RUNNING
            # the block table covers the step's tokens
            num_tokens = s.num_computed_tokens + s.num_new_tokens
            assert len(manager.get_block_ids(s.request.request_id)) * manager.block_size >= (
                num_tokens
            )
            assert num_tokens <= s.request.num_tokens
            # the plan carries the block table the runner will use
            assert s.block_ids == manager.get_block_ids(s.request.request_id)
        assert output.num_batched_tokens == sum(s.num_new_tokens for s in output.scheduled)
        assert output.num_batched_tokens <= self.scheduler.max_num_batched_tokens

    @invariant()
    def blocks_are_accounted_for(self):
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        holders = [0] * pool.num_blocks
        for blocks in manager.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] += 1
        assert [block.ref_cnt for block in pool.blocks] == holders
        num_used = sum(h > 0 for h in holders)
        assert pool.get_num_free_blocks() + num_used == pool.num_blocks

    @invariant()
    def only_live_requests_hold_blocks(self):
        live = {r.request_id for r in self.scheduler.running}
        assert set(self.scheduler.kv_cache_manager.req_to_blocks) == live

    def teardown(self):
        steps = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            self.blocks_are_accounted_for()
            steps += 1
            assert steps < 1000, "requests never finish"
        for request in self.requests:
            assert request.is_finished
            if request.status is RequestStatus.FINISHED_LENGTH:
                assert request.num_output_tokens == request.sampling_params.max_tokens or (
                    request.num_tokens == self.max_model_len
                )
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
