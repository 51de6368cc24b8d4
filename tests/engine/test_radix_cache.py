"""The radix cache against a brute-force oracle: the longest cached prefix among the inserted
sequences. Stateful tests add locks and eviction and check the tree's invariants after every
step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm.core.radix_cache import RadixCache, RadixNode, common_prefix_len

# a small alphabet makes shared prefixes, splits and partial matches common
tokens = st.lists(st.integers(0, 3), max_size=12)


def oracle_match(sequences, query) -> int:
    """The longest prefix of `query` that is a prefix of some inserted sequence."""
    return max((common_prefix_len(s, query) for s in sequences), default=0)


def path_of(node: RadixNode) -> tuple[int, ...]:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


def check_tree(cache: RadixCache) -> None:
    """Structure: parents and children agree, spans are non-empty and children start with
    distinct tokens, a lock on a node is a lock on its parent, the token count adds up."""
    total = 0
    stack = [cache.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node
            assert child.key and child.key[0] == first
            if node is not cache.root:
                assert node.lock_ref >= child.lock_ref
            total += len(child.key)
            stack.append(child)
    assert total == cache.num_cached_tokens


@given(st.lists(tokens, max_size=12), st.lists(tokens, max_size=8))
def test_match_prefix_is_the_longest_inserted_prefix(inserted, queries):
    cache = RadixCache()
    for i, seq in enumerate(inserted):
        assert cache.insert(seq) == oracle_match(inserted[:i], seq)
        check_tree(cache)
    for query in queries + inserted:
        matched, node = cache.match_prefix(query)
        assert matched == oracle_match(inserted, query)
        assert path_of(node) == tuple(query[:matched])  # the node spells the match exactly
        check_tree(cache)
    # tokens stored once: the size of the set of all distinct prefixes
    prefixes = {tuple(s[:i]) for s in inserted for i in range(1, len(s) + 1)}
    assert cache.num_cached_tokens == len(prefixes)


def test_match_splits_a_node_and_keeps_the_content():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    matched, node = cache.match_prefix([1, 2, 9])
    assert matched == 2 and node.key == (1, 2)
    assert cache.cached_sequences() == [(1, 2, 3, 4)]
    assert cache.insert([1, 2, 9]) == 2
    assert cache.cached_sequences() == [(1, 2, 3, 4), (1, 2, 9)]
    assert cache.num_cached_tokens == 5


def test_a_block_cache_misses_what_the_radix_cache_finds():
    # a 20-token shared prefix: a 16-token block cache can reuse 16 tokens, the radix tree 20
    cache = RadixCache()
    shared = list(range(100, 120))
    cache.insert(shared + [1, 2, 3])
    matched, _ = cache.match_prefix(shared + [7, 8])
    assert matched == 20


def test_evicts_least_recently_used_leaf_first():
    cache = RadixCache()
    cache.insert([1, 1, 1])  # leaf A
    cache.insert([2, 2])  # leaf B
    cache.insert([3])  # leaf C
    cache.match_prefix([1, 1, 1])  # A is now the most recently used
    assert cache.evict(1) == 2  # B (2 tokens) was the least recent
    assert cache.cached_sequences() == [(1, 1, 1), (3,)]
    assert cache.evict(1) == 1  # then C
    assert cache.cached_sequences() == [(1, 1, 1)]


def test_eviction_goes_leaf_first_and_frees_a_branch_tail_first():
    cache = RadixCache()
    cache.insert([5, 6, 7, 8])
    cache.insert([5, 6, 9])  # splits: (5, 6) with children (7, 8) and (9,)
    cache.match_prefix([5, 6, 9])  # (9,) recent, (7, 8) old
    assert cache.evict(1) == 2
    assert cache.cached_sequences() == [(5, 6, 9)]
    assert cache.evict(100) == 3  # (9,), then its parent (5, 6) once it is a leaf
    assert cache.num_cached_tokens == 0 and cache.cached_sequences() == []


def test_locked_paths_are_not_evicted():
    cache = RadixCache()
    cache.insert([1, 2, 3])
    cache.insert([4, 5])
    _, node = cache.match_prefix([1, 2])  # split: lock only (1, 2)
    cache.inc_lock_ref(node)
    assert cache.evictable_tokens() == 3  # (3,) and (4, 5)
    assert cache.evict(100) == 3
    assert cache.cached_sequences() == [(1, 2)]
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 2
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node.children.get(1, node))


class RadixCacheMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, unlocks and evictions; the model is the list of
    inserted sequences and the locked prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache()
        self.inserted: list[list[int]] = []
        self.locks: list[tuple[RadixNode, tuple[int, ...]]] = []

    @rule(seq=tokens)
    def insert(self, seq):
        already = self.cache.insert(seq)
        assert already <= oracle_match(self.inserted, seq)
        self.inserted.append(seq)
        assert self.cache.match_prefix(seq)[0] == len(seq)

    @rule(query=tokens)
    def match(self, query):
        matched, node = self.cache.match_prefix(query)
        # eviction only removes: what is found was inserted, and at most what the oracle finds
        assert matched <= oracle_match(self.inserted, query)
        assert path_of(node) == tuple(query[:matched])

    @rule(query=tokens)
    def lock(self, query):
        matched, node = self.cache.match_prefix(query)
        if matched:
            self.cache.inc_lock_ref(node)
            self.locks.append((node, tuple(query[:matched])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        index = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(index)
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, 20))
    def evict(self, num_tokens):
        evictable = self.cache.evictable_tokens()
        before = self.cache.num_cached_tokens
        freed = self.cache.evict(num_tokens)
        assert freed == before - self.cache.num_cached_tokens
        # enough is freed, unless everything unlocked went
        assert freed >= num_tokens or freed == evictable

    @invariant()
    def tree_is_consistent(self):
        check_tree(self.cache)

    @invariant()
    def locked_prefixes_stay_cached(self):
        for _, prefix in self.locks:
            assert self.cache.match_prefix(list(prefix))[0] == len(prefix)

    @invariant()
    def everything_cached_was_inserted(self):
        for seq in self.cache.cached_sequences():
            assert oracle_match(self.inserted, seq) == len(seq)


TestRadixCacheMachine = RadixCacheMachine.TestCase
TestRadixCacheMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
