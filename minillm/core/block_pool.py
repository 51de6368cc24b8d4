"""Block pool: fixed-size KV-cache blocks with reference counts, a free list and a prefix cache.

The KV cache is cut into `num_blocks` blocks of `block_size` token slots each. A block is in
use while at least one request's block table holds it (`ref_cnt > 0`). Free blocks wait in a
free list in the order they were freed. A free block that holds a full, hashed block of tokens
stays findable by its hash (the prefix cache) until the free list hands it out again, so the
cached blocks nobody uses are evicted least recently used first (LRU).

With `prefix_caching_algo="radix"` a radix tree over pages of tokens (`RadixCache`) indexes the
cached blocks instead of their hashes, and it decides what to evict, as in SGLang: a free block
the tree still indexes stays out of the free list until the tree gives it up, which it does
leaf by leaf, least recently used first, only when no uncached free block is left.
"""

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from minillm.core.radix_cache import RadixCache, RadixNode


@dataclass(slots=True)
class KVCacheBlock:
    """One block of KV-cache slots: keys and values of `block_size` tokens in every layer."""

    block_id: int
    # how many block tables hold this block; 0 means it is in the free list
    ref_cnt: int = 0
    # chained hash of the block's tokens while the prefix cache can find it, else None
    block_hash: int | None = None
    in_radix_tree: bool = False  # prefix_caching_algo="radix": the tree can find it


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained block hash: SHA-256 of the previous block's hash and this block's token ids.

    The parent hash covers every earlier block, so the hash of block i identifies the whole
    prefix of tokens 0 .. (i + 1) * block_size - 1, not just the block's own tokens. The bytes
    hashed are fixed (the parent as 32 big-endian bytes, 0 for the first block, then each token
    as a little-endian int64), so every process computes the same value, unlike Python's hash().
    """
    parent = 0 if parent_hash is None else parent_hash
    data = parent.to_bytes(32, "big") + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


class BlockPool:
    """All KV-cache blocks, the free list, and the prefix cache's map from hash to block."""

    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool, radix: RadixCache | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        # free list, block_id -> block: the head is the least recently freed, reused first
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        # prefix cache: full blocks by hash, in use or free (until reused)
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        # prefix_caching_algo="radix": the tree of cached blocks, and how many of them are free
        self.radix = radix
        self.num_free_in_tree = 0

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included: they can be reused at any time."""
        return len(self.free_block_queue) + self.num_free_in_tree

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free list, each with ref_cnt 1.

        A cached block taken here is evicted: new tokens will overwrite its slots, so the
        prefix cache must no longer find it.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.get_num_free_blocks()} are free"
            )
        if num_blocks > len(self.free_block_queue):
            self._evict_from_tree(num_blocks - len(self.free_block_queue))
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; a block nobody holds joins the free-list tail.

        A freed block keeps its hash: the prefix cache still finds it until get_new_blocks
        reuses it, which happens in the order the blocks were freed (LRU eviction).
        """
        for block in blocks:
            if block.ref_cnt < 1:
                raise ValueError(f"block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.in_radix_tree:
                    self.num_free_in_tree += 1  # stays findable until the tree evicts it
                else:
                    self.free_block_queue[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit or a fork).

        A hit on a free cached block takes it back out of the free list, so it cannot be evicted
        while a request uses it.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                if block.in_radix_tree:
                    self.num_free_in_tree -= 1
                else:
                    del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The block holding the prefix with this chained hash, or None on a cache miss."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Make a full, computed block findable by its chained hash.

        When another block already holds the same prefix (two requests computed it at the same
        time), that one stays the cached copy and this block remains an ordinary block.
        """
        if not self.enable_prefix_caching:
            raise RuntimeError("cache_full_block called on a pool without prefix caching")
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already cached")
        if block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def add_to_tree(self, block: KVCacheBlock) -> None:
        """A block the radix tree now indexes (prefix_caching_algo="radix")."""
        if block.in_radix_tree or block.ref_cnt < 1:
            raise ValueError(f"block {block.block_id} cannot join the tree")
        block.in_radix_tree = True

    def _evict_from_tree(self, num_blocks: int) -> None:
        """Let the radix tree give up at least `num_blocks` free blocks, LRU leaves first; a
        leaf goes only when no request holds any of its blocks."""
        if self.radix is None:
            return

        def is_free(node: RadixNode) -> bool:
            return all(block.ref_cnt == 0 for block in node.value)

        def release(node: RadixNode) -> None:
            for block in node.value:
                block.in_radix_tree = False
                self.num_free_in_tree -= 1
                self.free_block_queue[block.block_id] = block

        self.radix.evict(num_blocks * self.radix.page_size, can_evict=is_free, on_evict=release)
