"""The scheduler of a decode instance whose prompts run on a prefill instance
(`remote_prefill=True`): a request whose prompt is done waits for its KV outside the running
batch while the others keep stepping, joins with the first token when the KV lands, and an
abort while its KV is in transfer gives the blocks back only once the transfer is over."""

from __future__ import annotations

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.request import Request, RequestStatus
from minillm.core.scheduler import Scheduler
from minillm.outputs import SampledToken
from minillm.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK_SIZE = 32, 4


def make_scheduler() -> Scheduler:
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, False)
    return Scheduler(manager, 8, 16, 64, True, clock=lambda: 0.0, remote_prefill=True)


def request(request_id: str, num_prompt_tokens: int, max_tokens: int = 3, n: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    prompt = list(range(1, num_prompt_tokens + 1))
    req = Request(request_id, prompt, params, arrival_time=0.0)
    req.pending_forks = [
        Request(f"{request_id}#{i}", prompt, params, arrival_time=0.0, index=i) for i in range(1, n)
    ]
    return req


def decode_tokens(plan) -> dict[str, SampledToken]:
    """What the decode rank returns: a token for every decode row, none for prefill chunks."""
    return {
        seq.request_id: SampledToken(5)
        for chunk in plan.scheduled
        if chunk.phase == "decode"
        for seq in chunk.sampling_seqs
    }


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_finished_prompt_waits_for_its_kv_while_the_others_step():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", 3, max_tokens=4))
    plan = scheduler.schedule()
    assert scheduler.update_from_output(plan, decode_tokens(plan)) == []  # no token yet
    a = scheduler.waiting_for_remote_kvs["a"]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and a.num_computed_tokens == 3
    assert scheduler.running == [] and scheduler.has_unfinished_requests()
    # a long prompt arrives and is chunked over two steps; "a" is never planned meanwhile
    scheduler.add_request(request("b", 20))
    for _ in range(2):
        plan = scheduler.schedule()
        assert [c.request.request_id for c in plan.scheduled] == ["b"]
        scheduler.update_from_output(plan, decode_tokens(plan))
    assert set(scheduler.waiting_for_remote_kvs) == {"a", "b"}
    # a's KV lands: it rejoins with the prefill rank's token and decodes from the next step
    assert [r.request_id for r in scheduler.update_from_remote_kvs([("a", SampledToken(9))])] == [
        "a"
    ]
    assert a.status == RequestStatus.RUNNING and a.output_token_ids == [9]
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.phase, c.num_new_tokens) for c in plan.scheduled] == [
        ("a", "decode", 1)
    ]
    progressed = scheduler.update_from_output(plan, decode_tokens(plan))
    assert progressed == [a] and a.output_token_ids == [9, 5]


def test_forks_wait_with_their_parent_and_hold_their_seats():
    scheduler = make_scheduler()
    scheduler.add_request(request("p", 5, n=2))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, decode_tokens(plan))
    assert set(scheduler.waiting_for_remote_kvs) == {"p", "p#1"}
    assert scheduler.num_running_seqs == 2
    arrived = [("p", SampledToken(3)), ("p#1", SampledToken(4))]
    seqs = scheduler.update_from_remote_kvs(arrived)
    assert [s.output_token_ids for s in seqs] == [[3], [4]]
    assert scheduler.num_running_seqs == 2 and not scheduler.waiting_for_remote_kvs


def test_abort_while_kv_in_transfer_frees_its_blocks_when_the_transfer_lands():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", 10))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, decode_tokens(plan))
    held = NUM_BLOCKS - free_blocks(scheduler)
    assert held == 3  # 10 tokens in blocks of 4
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert free_blocks(scheduler) == NUM_BLOCKS - held  # the transfer still writes into them
    # the id is used again at once; the old transfer lands first, then the new one
    scheduler.add_request(request("a", 2))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, decode_tokens(plan))
    assert free_blocks(scheduler) == NUM_BLOCKS - held - 1
    assert scheduler.update_from_remote_kvs([("a", SampledToken(1))]) == []
    assert free_blocks(scheduler) == NUM_BLOCKS - 1 and not scheduler.finished_awaiting_kvs
    [again] = scheduler.update_from_remote_kvs([("a", SampledToken(2))])
    assert again.output_token_ids == [2]
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert free_blocks(scheduler) == NUM_BLOCKS


def test_a_first_token_that_ends_the_request_finishes_it_on_arrival():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", 3, max_tokens=1))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, decode_tokens(plan))
    [a] = scheduler.update_from_remote_kvs([("a", SampledToken(8))])
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert free_blocks(scheduler) == NUM_BLOCKS and not scheduler.has_unfinished_requests()


def test_a_step_taken_back_holds_the_blocks_of_its_transfers_once():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", 10))
    scheduler.add_request(request("b", 6))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, decode_tokens(plan))
    # "a" was aborted while its KV was in transfer: finish_requests holds its 3 blocks; the
    # step is then taken back, and holding "a" again must neither fail nor hold them twice
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    scheduler.hold_for_transfer("a")
    assert [len(blocks) for blocks in scheduler.finished_awaiting_kvs["a"]] == [3]
    scheduler.hold_for_transfer("b")
    assert [len(blocks) for blocks in scheduler.finished_awaiting_kvs["b"]] == [2]
    assert free_blocks(scheduler) == NUM_BLOCKS - 5
    scheduler.update_from_remote_kvs([("a", SampledToken(1))])
    assert free_blocks(scheduler) == NUM_BLOCKS - 2
