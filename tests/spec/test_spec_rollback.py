"""Rolling back rejected drafts conserves blocks: hypothesis over k, block size, pool size
and acceptance patterns, against a brute-force model of each block table.

The scheduler runs with speculation against a stand-in for the runner that proposes a drawn
number of drafts and accepts a drawn prefix of them. After every step, for every request:
its table holds exactly the blocks its computed tokens need when it just speculated (the
rejected drafts' slots are gone), never fewer than they need; every block's reference count
is the number of tables holding it; free plus held blocks make the pool; and each prefix-cache
hash a request records is the chained hash of its own accepted tokens, recomputed from scratch.
At the end every block is free.
"""

from __future__ import annotations

import hashlib
import struct

from hypothesis import given
from hypothesis import strategies as st

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.request import Request
from minillm.core.scheduler import Scheduler
from minillm.outputs import SampledToken
from minillm.sampling_params import SamplingParams


def brute_hash(parent: int | None, tokens: list[int]) -> int:
    data = (parent or 0).to_bytes(32, "big") + b"".join(struct.pack("<q", t) for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def check_invariants(manager: KVCacheManager, scheduler: Scheduler, speculated: set[str]):
    pool = manager.block_pool
    holders: dict[int, int] = {}
    for request_id, table in manager.req_to_blocks.items():
        request = scheduler.requests[request_id]
        needed = -(-request.num_computed_tokens // manager.block_size)
        if request_id in speculated and not request.is_finished:
            assert len(table) == needed
        assert len(table) >= needed
        for block in table:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
        # recorded hashes: the chain over this request's own tokens, full computed blocks only
        hashes = manager.req_to_block_hashes[request_id]
        assert len(hashes) <= request.num_computed_tokens // manager.block_size
        parent = None
        for i, recorded in enumerate(hashes):
            bs = manager.block_size
            parent = brute_hash(parent, request.all_token_ids[i * bs : (i + 1) * bs])
            assert recorded == parent
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
    assert pool.get_num_free_blocks() == sum(block.ref_cnt == 0 for block in pool.blocks)


@given(
    k=st.integers(1, 4),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(10, 40),
    prompts=st.lists(st.lists(st.integers(2, 9), min_size=1, max_size=10), min_size=1, max_size=4),
    max_tokens=st.integers(1, 12),
    data=st.data(),
)
def test_blocks_are_conserved_through_rollbacks(
    k, block_size, num_blocks, prompts, max_tokens, data
):
    max_model_len = 24
    if -(-max_model_len // block_size) > num_blocks:
        num_blocks = -(-max_model_len // block_size)
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(
        manager,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=max_model_len,
        num_lookahead_tokens=k,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        prompt = prompt[: max_model_len - 2]
        scheduler.add_request(Request(str(i), prompt, params, arrival_time=float(i)))
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        sampled: dict = {}
        speculated = set()
        for chunk in plan.scheduled:
            request_id = chunk.request.request_id
            if chunk.num_lookahead_tokens:
                # the proposer offers up to the reserved drafts; a prefix of them is accepted
                num_drafts = data.draw(st.integers(0, chunk.num_lookahead_tokens))
                chunk.spec_token_ids = data.draw(
                    st.lists(st.integers(2, 9), min_size=num_drafts, max_size=num_drafts)
                )
                chunk.num_new_tokens -= chunk.num_lookahead_tokens - num_drafts
                accepted = data.draw(st.integers(0, num_drafts))
                extra = data.draw(st.integers(2, 9))
                tokens = chunk.spec_token_ids[:accepted] + [extra]
                sampled[request_id] = [SampledToken(t) for t in tokens]
                speculated.add(request_id)
            elif chunk.samples:
                sampled[request_id] = SampledToken(data.draw(st.integers(2, 9)))
        before = {c.request.request_id: c.request.num_tokens for c in plan.scheduled}
        scheduler.update_from_output(plan, sampled)
        for chunk in plan.scheduled:
            request = chunk.request
            if request.request_id in speculated and not request.is_finished:
                grown = request.num_tokens - before[request.request_id]
                assert grown == len(sampled[request.request_id])
                assert request.num_computed_tokens == request.num_tokens - 1
        check_invariants(manager, scheduler, speculated)
    assert not scheduler.has_unfinished_requests()
    assert manager.req_to_blocks == {}
    assert manager.block_pool.get_num_free_blocks() == num_blocks
