"""Tests for the block pool: allocation, reference counts, free-list order, block hashes."""

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from minillm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_block_queue)


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(4, enable_prefix_caching=True)
    assert pool.num_blocks == 4
    assert pool.get_num_free_blocks() == 4
    assert free_order(pool) == [0, 1, 2, 3]
    assert pool.usage == 0.0
    assert pool.blocks == [KVCacheBlock(i, 0, None) for i in range(4)]


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least 1"):
        BlockPool(0, enable_prefix_caching=True)


def test_get_new_blocks_takes_the_free_list_head_with_one_reference():
    pool = BlockPool(5, enable_prefix_caching=False)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_order(pool) == [3, 4]
    assert pool.usage == pytest.approx(3 / 5)


def test_get_new_blocks_raises_when_too_few_are_free_and_changes_nothing():
    pool = BlockPool(3, enable_prefix_caching=False)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks: only 1 are free"):
        pool.get_new_blocks(2)
    assert free_order(pool) == [2]


def test_free_blocks_appends_to_the_tail_in_the_order_given():
    pool = BlockPool(5, enable_prefix_caching=False)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0]])
    assert free_order(pool) == [4, 2, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 0, 1, 0]
    # the next allocation reuses the least recently freed block first
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 2]


def test_shared_block_is_freed_only_by_its_last_reference():
    pool = BlockPool(2, enable_prefix_caching=False)
    [block] = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_order(pool) == [1]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_order(pool) == [1, 0]


def test_freeing_a_free_block_raises():
    pool = BlockPool(2, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="block 1 is already free"):
        pool.free_blocks([pool.blocks[1]])


def test_freed_cached_block_stays_findable_until_reused_lru_first():
    pool = BlockPool(4, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_block(blocks[0], 100)
    pool.cache_full_block(blocks[1], 101)
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])
    assert free_order(pool) == [1, 0, 2]
    assert pool.get_cached_block(100) is blocks[0]
    assert pool.get_cached_block(101) is blocks[1]

    # reusing block 1 (least recently freed) evicts it: its hash leaves the map
    [reused] = pool.get_new_blocks(1)
    assert reused is blocks[1] and reused.block_hash is None and reused.ref_cnt == 1
    assert pool.get_cached_block(101) is None
    assert pool.get_cached_block(100) is blocks[0]
    assert pool.cached_block_hash_to_block == {100: blocks[0]}


def test_touch_takes_a_free_cached_block_out_of_the_free_list():
    pool = BlockPool(3, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_block(blocks[1], 7)
    pool.free_blocks(blocks)
    assert free_order(pool) == [0, 1, 2]
    hit = pool.get_cached_block(7)
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_order(pool) == [0, 2]
    # the hit is safe from eviction: allocating every free block leaves it alone
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 2]
    assert pool.get_cached_block(7) is hit
    assert pool.usage == 1.0


def test_second_block_with_a_cached_hash_stays_uncached():
    pool = BlockPool(2, enable_prefix_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, 5)
    pool.cache_full_block(second, 5)
    assert first.block_hash == 5 and second.block_hash is None
    assert pool.get_cached_block(5) is first


def test_cache_full_block_rejects_a_cached_block_and_a_pool_without_caching():
    pool = BlockPool(1, enable_prefix_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, 1)
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_block(block, 2)
    plain = BlockPool(1, enable_prefix_caching=False)
    with pytest.raises(RuntimeError, match="without prefix caching"):
        plain.cache_full_block(plain.get_new_blocks(1)[0], 1)


def test_block_hash_matches_an_independent_sha256():
    tokens = [1, 2, 3, 50_000]
    digest = hashlib.sha256(bytes(32) + struct.pack("<4q", *tokens)).digest()
    expected = int.from_bytes(digest, "big")
    assert hash_block_tokens(None, tokens) == expected
    child = hashlib.sha256(expected.to_bytes(32, "big") + struct.pack("<2q", 7, 8)).digest()
    assert hash_block_tokens(expected, [7, 8]) == int.from_bytes(child, "big")


def chain(blocks: list[list[int]]) -> list[int]:
    hashes, parent = [], None
    for block in blocks:
        parent = hash_block_tokens(parent, block)
        hashes.append(parent)
    return hashes


def test_hash_chain_depends_on_the_whole_prefix():
    base = chain([[1, 2], [3, 4], [5, 6]])
    assert chain([[1, 2], [3, 4], [5, 6]]) == base
    assert chain([[1, 2], [3, 4], [9, 9]])[:2] == base[:2]
    # changing block 0 changes the hash of every later block, even with equal tokens
    changed = chain([[1, 0], [3, 4], [5, 6]])
    assert all(a != b for a, b in zip(changed, base, strict=True))
    assert hash_block_tokens(None, [3, 4]) != base[1]


def test_hash_is_the_same_in_another_process():
    code = (
        "from minillm.core.block_pool import hash_block_tokens; "
        "print(hash_block_tokens(None, [1, 2]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout) == hash_block_tokens(None, [1, 2])
