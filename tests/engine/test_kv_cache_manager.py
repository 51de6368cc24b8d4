"""Tests for the KV-cache manager: block tables, prefix caching, forks and copy-on-write."""

import copy
import hashlib
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm.core.kv_cache_manager import KVCacheManager, PrefixCacheStats


@dataclass
class Req:
    """The request attributes the manager reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def admit(manager: KVCacheManager, req: Req) -> bool:
    """Schedule a waiting request's whole prompt, with its prefix-cache hits."""
    computed_blocks, num_computed = manager.get_computed_blocks(req)
    num_new = len(req.all_token_ids) - num_computed
    if not manager.allocate_slots(req, num_new, computed_blocks):
        return False
    req.num_computed_tokens = num_computed
    step(manager, req, num_new, allocate=False)
    return True


def step(manager: KVCacheManager, req: Req, num_new: int, allocate: bool = True) -> None:
    """Compute num_new tokens of the request, then publish its full blocks."""
    if allocate:
        assert manager.allocate_slots(req, num_new)
    req.num_computed_tokens += num_new
    manager.cache_blocks(req, req.num_computed_tokens)


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def free_order(manager: KVCacheManager) -> list[int]:
    return list(manager.block_pool.free_block_queue)


def test_capacity_and_defaults():
    manager = KVCacheManager(10)
    assert manager.block_size == 16
    assert manager.num_tokens_capacity == 160
    assert manager.block_pool.enable_prefix_caching
    assert manager.usage == 0.0
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        KVCacheManager(10, block_size=0)


def test_allocate_prompt_then_decode_grows_one_block_per_block_size_tokens():
    manager = KVCacheManager(10, block_size=4)
    req = Req("a", list(range(10)))
    assert manager.allocate_slots(req, 10)
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.usage == pytest.approx(0.3)
    req.num_computed_tokens = 10
    req.all_token_ids.append(10)
    # token 10 lands in slot 2 of block 2: no new block
    assert manager.allocate_slots(req, 1)
    assert manager.get_block_ids("a") == [0, 1, 2]
    req.num_computed_tokens = 12
    req.all_token_ids.append(11)
    # token 12 needs block 3
    assert manager.allocate_slots(req, 1)
    assert manager.get_block_ids("a") == [0, 1, 2, 3]
    assert ref_cnts(manager)[:5] == [1, 1, 1, 1, 0]


def test_chunked_prefill_allocates_chunk_by_chunk():
    manager = KVCacheManager(10, block_size=4)
    req = Req("a", list(range(10)))
    assert manager.allocate_slots(req, 3)
    assert manager.get_block_ids("a") == [0]
    req.num_computed_tokens = 3
    assert manager.allocate_slots(req, 3)
    assert manager.get_block_ids("a") == [0, 1]


def test_allocate_is_all_or_nothing():
    manager = KVCacheManager(4, block_size=4)
    big = Req("big", list(range(17)))
    assert not manager.allocate_slots(big, 17)
    assert manager.block_pool.get_num_free_blocks() == 4
    assert "big" not in manager.req_to_blocks
    with pytest.raises(KeyError):
        manager.get_block_ids("big")
    assert manager.prefix_cache_stats == PrefixCacheStats(0, 0)
    assert manager.allocate_slots(big, 16)
    assert manager.get_block_ids("big") == [0, 1, 2, 3]


def test_allocate_rejects_bad_arguments():
    manager = KVCacheManager(4, block_size=4)
    req = Req("a", list(range(9)))
    with pytest.raises(ValueError, match="num_new_tokens must be at least 1"):
        manager.allocate_slots(req, 0)
    assert admit(manager, req)
    hits, _ = manager.get_computed_blocks(Req("b", list(range(9))))
    with pytest.raises(ValueError, match="start the table of a new request"):
        manager.allocate_slots(req, 1, hits)


def test_prefix_hit_shares_the_cached_blocks():
    manager = KVCacheManager(10, block_size=4)
    a = Req("a", list(range(10)))
    assert admit(manager, a)
    assert manager.get_block_ids("a") == [0, 1, 2]
    # blocks 0 and 1 are full, block 2 holds 2 tokens and is not cached
    assert [manager.block_pool.blocks[i].block_hash is not None for i in range(3)] == [
        True,
        True,
        False,
    ]
    b = Req("b", list(range(8)) + [100, 101, 102])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert [block.block_id for block in hits] == [0, 1]
    assert num_hit_tokens == 8
    assert manager.allocate_slots(b, 3, hits)
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert ref_cnts(manager)[:4] == [2, 2, 1, 1]
    assert manager.prefix_cache_stats.num_queried_tokens == 21
    assert manager.prefix_cache_stats.num_hit_tokens == 8


def test_a_fully_cached_prompt_recomputes_its_last_block():
    manager = KVCacheManager(10, block_size=4)
    assert admit(manager, Req("a", list(range(8))))
    assert manager.get_block_ids("a") == [0, 1]
    # 8 tokens = 2 full cached blocks, but the last token must be computed: 1 block is a hit
    hits, num_hit_tokens = manager.get_computed_blocks(Req("b", list(range(8))))
    assert [block.block_id for block in hits] == [0]
    assert num_hit_tokens == 4
    # one more token and both blocks are hits
    hits, num_hit_tokens = manager.get_computed_blocks(Req("c", list(range(9))))
    assert [block.block_id for block in hits] == [0, 1]
    assert num_hit_tokens == 8
    # a prompt of one block or less has nothing to look up
    assert manager.get_computed_blocks(Req("d", list(range(4)))) == ([], 0)


def test_recomputed_duplicate_block_is_not_cached_twice():
    manager = KVCacheManager(10, block_size=4)
    assert admit(manager, Req("a", list(range(8))))
    b = Req("b", list(range(8)))
    assert admit(manager, b)
    assert manager.get_block_ids("b") == [0, 2]
    assert manager.block_pool.blocks[2].block_hash is None
    assert (
        manager.block_pool.get_cached_block(manager.block_pool.blocks[1].block_hash).block_id == 1
    )


def test_free_returns_blocks_last_first_and_they_stay_cached():
    manager = KVCacheManager(6, block_size=4)
    a = Req("a", list(range(14)))
    assert admit(manager, a)
    assert manager.get_block_ids("a") == [0, 1, 2, 3]
    manager.free(a)
    assert free_order(manager) == [4, 5, 3, 2, 1, 0]
    assert ref_cnts(manager) == [0] * 6
    assert "a" not in manager.req_to_blocks and "a" not in manager.req_to_block_hashes
    # the free cached blocks still answer lookups; a hit takes them off the free list
    b = Req("b", list(range(13)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert [block.block_id for block in hits] == [0, 1, 2] and num_hit_tokens == 12
    assert manager.allocate_slots(b, 1, hits)
    assert manager.get_block_ids("b") == [0, 1, 2, 4]
    assert free_order(manager) == [5, 3]
    # freeing a request that never got blocks is a no-op
    manager.free(Req("never", [1, 2]))


def test_eviction_is_lru_and_forgets_the_evicted_prefix():
    manager = KVCacheManager(4, block_size=4)
    a = Req("a", list(range(9)))
    assert admit(manager, a)  # blocks 0, 1 full and cached, block 2 partial
    manager.free(a)
    assert free_order(manager) == [3, 2, 1, 0]
    # a 12-token request with another prefix needs 3 blocks: 3, 2, then the cached block 1
    c = Req("c", [50 + t for t in range(12)])
    assert admit(manager, c)
    assert manager.get_block_ids("c") == [3, 2, 1]
    hits, num_hit_tokens = manager.get_computed_blocks(Req("d", list(range(9))))
    assert [block.block_id for block in hits] == [0] and num_hit_tokens == 4


def test_failed_allocation_does_not_take_prefix_hits():
    manager = KVCacheManager(4, block_size=4)
    a = Req("a", list(range(9)))
    assert admit(manager, a)
    manager.free(a)
    before = free_order(manager)
    # 2 free hits + 3 new blocks for 9 more tokens = 5 blocks, one more than the pool has
    b = Req("b", list(range(8)) + list(range(100, 109)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert [block.block_id for block in hits] == [0, 1]
    assert not manager.allocate_slots(b, 9, hits)
    assert free_order(manager) == before
    assert ref_cnts(manager) == [0, 0, 0, 0]
    assert manager.block_pool.get_cached_block(hits[1].block_hash) is hits[1]
    assert manager.prefix_cache_stats.num_queried_tokens == 9
    # the same request fits with fewer new tokens
    assert manager.allocate_slots(b, 8, hits)
    assert manager.get_block_ids("b") == [0, 1, 3, 2]


def test_preempted_request_is_readded_from_scratch_and_hits_its_own_blocks():
    manager = KVCacheManager(8, block_size=4)
    a = Req("a", list(range(6)))
    assert admit(manager, a)
    for token in (6, 7, 8):
        a.all_token_ids.append(token)
        step(manager, a, 1)
    assert a.num_computed_tokens == 9
    manager.free(a)
    a.num_computed_tokens = 0
    hits, num_hit_tokens = manager.get_computed_blocks(a)
    # the output tokens' block was cached too
    assert [block.block_id for block in hits] == [0, 1] and num_hit_tokens == 8


def test_fork_shares_blocks_and_copy_on_write_splits_the_written_block():
    manager = KVCacheManager(6, block_size=4)
    parent = Req("p", list(range(6)))
    assert admit(manager, parent)
    child = Req("c", list(parent.all_token_ids), parent.num_computed_tokens)
    manager.fork(parent, child)
    assert manager.get_block_ids("c") == [0, 1]
    assert ref_cnts(manager)[:3] == [2, 2, 0]
    assert manager.take_copy_on_write() == []

    # the child writes token 6 into the shared partial block 1: it gets a private copy
    child.all_token_ids.append(99)
    assert manager.allocate_slots(child, 1)
    assert manager.get_block_ids("c") == [0, 2]
    assert ref_cnts(manager)[:3] == [2, 1, 1]
    assert manager.take_copy_on_write() == [(1, 2)]
    assert manager.take_copy_on_write() == []

    # block 1 is the parent's alone now: no copy
    parent.all_token_ids.append(42)
    assert manager.allocate_slots(parent, 1)
    assert manager.get_block_ids("p") == [0, 1]
    assert manager.take_copy_on_write() == []

    manager.free(parent)
    assert ref_cnts(manager)[:3] == [1, 0, 1]
    manager.free(child)
    assert manager.block_pool.get_num_free_blocks() == 6


def test_fork_at_a_block_boundary_needs_no_copy():
    manager = KVCacheManager(6, block_size=4)
    parent = Req("p", list(range(8)))
    assert admit(manager, parent)
    child = Req("c", list(parent.all_token_ids), 8)
    manager.fork(parent, child)
    child.all_token_ids.append(1)
    assert manager.allocate_slots(child, 1)
    assert manager.get_block_ids("c") == [0, 1, 2]
    assert manager.take_copy_on_write() == []
    assert ref_cnts(manager)[:3] == [2, 2, 1]


def test_copy_on_write_is_all_or_nothing():
    manager = KVCacheManager(2, block_size=4)
    parent = Req("p", list(range(6)))
    assert admit(manager, parent)
    child = Req("c", list(parent.all_token_ids) + [7], parent.num_computed_tokens)
    manager.fork(parent, child)
    assert not manager.allocate_slots(child, 1)
    assert manager.get_block_ids("c") == [0, 1]
    assert ref_cnts(manager) == [2, 2]
    assert manager.take_copy_on_write() == []


def test_fork_hashes_continue_from_the_parent():
    manager = KVCacheManager(8, block_size=4)
    parent = Req("p", list(range(6)))
    assert admit(manager, parent)
    child = Req("c", list(parent.all_token_ids), parent.num_computed_tokens)
    manager.fork(parent, child)
    for token in (6, 7):
        child.all_token_ids.append(token)
        step(manager, child, 1)
    # the child's block 1 (the copy) is now full and cached under the prefix 0..7
    hits, _ = manager.get_computed_blocks(Req("x", list(range(9))))
    assert [block.block_id for block in hits] == manager.get_block_ids("c")[:2] == [0, 2]


def test_fork_rejects_unknown_parent_and_existing_child():
    manager = KVCacheManager(4, block_size=4)
    parent = Req("p", [1, 2, 3])
    with pytest.raises(ValueError, match="has no blocks"):
        manager.fork(parent, Req("c", [1, 2, 3]))
    assert admit(manager, parent)
    with pytest.raises(ValueError, match="already has blocks"):
        manager.fork(parent, parent)


def test_without_prefix_caching_nothing_is_hashed_or_counted():
    manager = KVCacheManager(6, block_size=4, enable_prefix_caching=False)
    a = Req("a", list(range(9)))
    assert admit(manager, a)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(Req("b", list(range(9)))) == ([], 0)
    assert manager.prefix_cache_stats == PrefixCacheStats(0, 0)


def test_cache_blocks_rejects_more_computed_tokens_than_the_table_holds():
    manager = KVCacheManager(4, block_size=4)
    a = Req("a", list(range(9)))
    assert manager.allocate_slots(a, 4)
    with pytest.raises(ValueError, match="need 2 blocks"):
        manager.cache_blocks(a, 8)


# Stateful test: random admissions, steps, forks, preemptions and finishes against a model of
# what every block's slots hold. The KV tensor is simulated as block_id -> token ids written.
BLOCK_SIZE = 4
NUM_BLOCKS = 8
# shared beginnings, so that requests hit each other's blocks in the prefix cache
PREFIXES = [[], [1] * 4 + [2] * 4, [1] * 4 + [3] * 4, [5, 6, 7, 8, 9, 10]]
# few distinct token ids, so that random blocks also repeat
token_ids = st.integers(min_value=0, max_value=3)


def sha256_chain(token_ids: list[int]) -> list[int]:
    """Chained SHA-256 of each full block, written out independently of block_pool."""
    hashes, parent = [], bytes(32)
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        data = b"".join(
            t.to_bytes(8, "little", signed=True) for t in token_ids[start : start + BLOCK_SIZE]
        )
        parent = hashlib.sha256(parent + data).digest()
        hashes.append(int.from_bytes(parent, "big"))
    return hashes


class KVCacheMachine(RuleBasedStateMachine):
    """A scheduler's calls in random order; every step writes its tokens into `slots`."""

    ALGO = "hash"

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, prefix_caching_algo=self.ALGO)
        self.pool = self.manager.block_pool
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        # requests related by forks form a family; only a family shares uncached blocks
        self.family: dict[str, int] = {}
        self.slots: dict[int, list[int | None]] = {
            i: [None] * BLOCK_SIZE for i in range(NUM_BLOCKS)
        }
        self.num_requests = 0

    def new_request_id(self) -> str:
        self.num_requests += 1
        return f"r{self.num_requests}"

    def snapshot(self) -> tuple:
        tables = {rid: self.manager.get_block_ids(rid) for rid in self.manager.req_to_blocks}
        cached = {h: b.block_id for h, b in self.pool.cached_block_hash_to_block.items()}
        stats = self.manager.prefix_cache_stats
        blocks = [(b.ref_cnt, b.block_hash) for b in self.pool.blocks]
        queue = list(self.pool.free_block_queue)
        counters = (stats.num_queried_tokens, stats.num_hit_tokens)
        return queue, blocks, tables, cached, counters, list(self.manager.pending_block_copies)

    def compute(self, req: Req, num_new: int, next_token: int) -> None:
        """Run one step of the request: copy-on-write, write its new tokens, publish blocks."""
        for src, dst in self.manager.take_copy_on_write():
            self.slots[dst] = list(self.slots[src])
        table = self.manager.get_block_ids(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            block_id = table[pos // BLOCK_SIZE]
            assert self.pool.blocks[block_id].ref_cnt == 1, "writing into a shared block"
            self.slots[block_id][pos % BLOCK_SIZE] = req.all_token_ids[pos]
        req.num_computed_tokens += num_new
        self.manager.cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens == len(req.all_token_ids):
            req.all_token_ids.append(next_token)  # the sampled token

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(token_ids, min_size=1, max_size=9))
    def add_request(self, prefix: list[int], suffix: list[int]) -> None:
        req = Req(self.new_request_id(), prefix + suffix)
        self.family[req.request_id] = self.num_requests
        self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def add_copy_of_running_request(self, data: st.DataObject) -> None:
        # its whole prompt may be cached: a multiple of BLOCK_SIZE must still compute a block
        other = data.draw(st.sampled_from(self.running))
        req = Req(self.new_request_id(), other.all_token_ids[: other.num_computed_tokens])
        self.family[req.request_id] = self.num_requests
        self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12), next_token=token_ids)
    def admit(self, data: st.DataObject, chunk: int, next_token: int) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        hits, num_hit_tokens = self.manager.get_computed_blocks(req)
        assert num_hit_tokens == len(hits) * BLOCK_SIZE < len(req.all_token_ids)
        num_new = min(chunk, len(req.all_token_ids) - num_hit_tokens)
        before = self.snapshot()
        if not self.manager.allocate_slots(req, num_new, hits):
            assert self.snapshot() == before
            return
        self.waiting.remove(req)
        self.running.append(req)
        req.num_computed_tokens = num_hit_tokens
        self.compute(req, num_new, next_token)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 6), next_token=token_ids)
    def step(self, data: st.DataObject, chunk: int, next_token: int) -> None:
        req = data.draw(st.sampled_from(self.running))
        num_new = min(chunk, len(req.all_token_ids) - req.num_computed_tokens)
        before = self.snapshot()
        if not self.manager.allocate_slots(req, num_new):
            assert self.snapshot() == before
            return
        self.compute(req, num_new, next_token)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), next_token=token_ids)
    def fork(self, data: st.DataObject, next_token: int) -> None:
        parent = data.draw(st.sampled_from(self.running))
        # the child shares what the parent computed and samples its own next token
        computed = parent.all_token_ids[: parent.num_computed_tokens]
        child = Req(self.new_request_id(), computed + [next_token], parent.num_computed_tokens)
        self.family[child.request_id] = self.family[parent.request_id]
        self.manager.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.manager.free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.append(req)

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running + self.waiting))
        self.manager.free(req)
        (self.running if req in self.running else self.waiting).remove(req)

    @invariant()
    def ref_cnts_count_block_tables(self) -> None:
        assert set(self.manager.req_to_blocks) == {req.request_id for req in self.running}
        holders = Counter(
            block_id
            for req in self.running
            for block_id in self.manager.get_block_ids(req.request_id)
        )
        for block in self.pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders[block.block_id]
            # radix: a free block the tree indexes waits outside the free list
            free_listed = block.ref_cnt == 0 and not block.in_radix_tree
            assert free_listed == (block.block_id in self.pool.free_block_queue)
        num_used = sum(block.ref_cnt > 0 for block in self.pool.blocks)
        assert self.pool.get_num_free_blocks() + num_used == NUM_BLOCKS
        assert self.manager.usage == pytest.approx(num_used / NUM_BLOCKS)

    @invariant()
    def blocks_are_shared_only_by_forks_or_the_prefix_cache(self) -> None:
        holders: dict[int, set[tuple[int, int]]] = {}
        for req in self.running:
            for index, block_id in enumerate(self.manager.get_block_ids(req.request_id)):
                holders.setdefault(block_id, set()).add((self.family[req.request_id], index))
        for block_id, family_and_index in holders.items():
            # a shared block sits at the same position of every table that holds it
            assert len({index for _, index in family_and_index}) == 1
            if len({family for family, _ in family_and_index}) > 1:
                block = self.pool.blocks[block_id]
                assert block.block_hash is not None or block.in_radix_tree

    @invariant()
    def every_block_counted_free_can_be_allocated(self) -> None:
        # what the scheduler is told is free must be there when it allocates: a copy of the
        # pool hands out that many blocks (the radix tree evicting what it must) and no more
        pool = copy.deepcopy(self.pool)
        num_free = pool.get_num_free_blocks()
        assert num_free == sum(block.ref_cnt == 0 for block in self.pool.blocks)
        taken = pool.get_new_blocks(num_free)
        assert len({block.block_id for block in taken}) == num_free
        assert all(block.ref_cnt >= 1 for block in pool.blocks)

    @invariant()
    def every_table_shows_its_requests_tokens(self) -> None:
        for req in self.running:
            table = self.manager.get_block_ids(req.request_id)
            num_computed = req.num_computed_tokens
            assert len(table) == (num_computed + BLOCK_SIZE - 1) // BLOCK_SIZE
            seen = [
                self.slots[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                for pos in range(num_computed)
            ]
            assert seen == req.all_token_ids[:num_computed]

    @invariant()
    def cached_blocks_carry_the_hash_of_their_prefix(self) -> None:
        for req in self.running:
            blocks = self.manager.req_to_blocks[req.request_id]
            expected = sha256_chain(req.all_token_ids[: req.num_computed_tokens])
            for block, block_hash in zip(blocks, expected, strict=False):
                assert block.block_hash in (None, block_hash)

    @invariant()
    def prefix_cache_map_matches_block_hashes(self) -> None:
        cached = self.pool.cached_block_hash_to_block
        assert all(block.block_hash == block_hash for block_hash, block in cached.items())
        assert sum(block.block_hash is not None for block in self.pool.blocks) == len(cached)
        stats = self.manager.prefix_cache_stats
        assert 0 <= stats.num_hit_tokens < stats.num_queried_tokens or stats.num_queried_tokens == 0

    def teardown(self) -> None:
        for req in self.running:
            self.manager.free(req)
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS
        assert all(block.ref_cnt == 0 for block in self.pool.blocks)
        assert self.manager.req_to_blocks == {} and self.manager.usage == 0.0


TestKVCacheMachine = KVCacheMachine.TestCase


class RadixKVCacheMachine(KVCacheMachine):
    ALGO = "radix"


TestRadixKVCacheMachine = RadixKVCacheMachine.TestCase
TestRadixKVCacheMachine.settings = settings(max_examples=200, stateful_step_count=30)


# ---- the radix tree as the prefix cache (prefix_caching_algo="radix") ----


def test_the_radix_tree_finds_the_same_blocks_as_the_hashes():
    managers = {
        algo: KVCacheManager(12, block_size=4, prefix_caching_algo=algo)
        for algo in ("hash", "radix")
    }
    for manager in managers.values():
        assert admit(manager, Req("a", list(range(10))))
        assert admit(manager, Req("b", [*range(6), 50, 51, 52, 53, 54]))
    for tokens in (list(range(9)), [*range(4), 9, 9, 9, 9, 9], [*range(6), 50, 51, 52, 53, 54, 55]):
        found = {
            algo: [b.block_id for b in manager.get_computed_blocks(Req("q", tokens))[0]]
            for algo, manager in managers.items()
        }
        assert found["hash"] == found["radix"], tokens


def test_the_radix_tree_keeps_free_blocks_until_it_must_evict_its_lru_leaf():
    manager = KVCacheManager(6, block_size=2, prefix_caching_algo="radix")
    pool = manager.block_pool
    old, new = Req("old", [1, 2, 3, 4, 5]), Req("new", [7, 8, 9, 10, 11])
    assert admit(manager, old)  # 2 full blocks go into the tree, 1 partial block does not
    manager.free(old)
    assert admit(manager, new)
    manager.free(new)
    assert pool.get_num_free_blocks() == 6
    assert len(pool.free_block_queue) == 2  # the two partial blocks: not in the tree
    assert pool.num_free_in_tree == 4
    # asking for 3 blocks takes the 2 uncached ones, then evicts the least recently used leaf
    manager.get_computed_blocks(Req("touch-new", [7, 8, 9, 10, 0]))  # "new" was used last
    pool.get_new_blocks(3)
    assert manager.get_computed_blocks(Req("q", [1, 2, 3, 4, 0]))[1] == 0  # old: evicted
    assert manager.get_computed_blocks(Req("q", [7, 8, 9, 10, 0]))[1] == 4  # new: kept


def test_a_radix_block_in_use_is_never_evicted():
    manager = KVCacheManager(4, block_size=2, prefix_caching_algo="radix")
    a = Req("a", [1, 2, 3, 4, 5, 6])
    assert admit(manager, a)  # 3 blocks, all full, in the tree and held by a
    assert manager.block_pool.get_num_free_blocks() == 1
    with pytest.raises(ValueError, match="only 1 are free"):
        manager.block_pool.get_new_blocks(2)
    assert manager.get_computed_blocks(Req("b", [1, 2, 3, 4, 5, 6, 7]))[1] == 6


def test_a_prefix_computed_twice_at_once_is_adopted_from_the_tree():
    # a and b compute the same two blocks at the same time (neither finds the other's in the
    # cache); b's third block hangs below the tree's copy of them. When a finishes, its blocks
    # are free, and they must be evictable: b holds the tree's copies, not its own
    manager = KVCacheManager(7, block_size=2, prefix_caching_algo="radix")
    pool = manager.block_pool
    a, b = Req("a", [1, 2, 3, 4, 5]), Req("b", [1, 2, 3, 4, 6, 7, 8])
    assert manager.allocate_slots(a, 1) and manager.allocate_slots(b, 1)
    step(manager, a, 4)  # a's [1, 2], [3, 4] join the tree
    step(manager, b, 6)  # b computed its own [1, 2], [3, 4]; its [6, 7] joins below a's
    a_blocks = manager.get_block_ids("a")
    assert manager.get_block_ids("b")[:2] == a_blocks[:2]  # adopted
    manager.free(a)
    assert pool.get_num_free_blocks() == 7 - len(manager.get_block_ids("b"))
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert not {block.block_id for block in taken} & set(manager.get_block_ids("b"))
