"""KV-cache manager: the block table of every request, on top of the block pool.

A request's block table lists the blocks that hold its tokens' keys and values: token t lives
in slot t % block_size of block table[t // block_size]. The scheduler uses the manager in three
steps per request: look up the prompt's cached prefix (get_computed_blocks), reserve blocks for
the tokens of the next step (allocate_slots), and, after the step, publish the blocks that became
full to the prefix cache (cache_blocks). Forked requests share blocks until one of them writes
into a shared block, which is then copied (copy-on-write).

The prefix cache comes in two algorithms (`prefix_caching_algo`): "hash", vLLM's chained block
hashes, and "radix", SGLang's radix tree, here over pages of block_size tokens. Both find the
same blocks; they differ in how they find them and in which cached blocks they evict first.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minillm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from minillm.core.radix_cache import RadixCache

PREFIX_CACHING_ALGOS = ("hash", "radix")

if TYPE_CHECKING:
    from minillm.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters in tokens, counted once per request admission."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


def root_block_hash(request: Request) -> int | None:
    """The parent hash of a request's first block: None on the base model; with a LoRA adapter,
    a hash of the adapter's identity (its name and directory), so that every block hash of the
    chain names the adapter whose keys and values the block holds (vLLM puts the request's LoRA
    in each block hash's extra keys). Requests on different adapters never share KV blocks. Not
    the lora_int_id: an id freed by evicting its adapter may name another adapter later, and
    its requests must not find the old adapter's blocks."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    path = os.path.abspath(os.path.expanduser(os.fspath(lora.lora_path)))
    identity = f"lora\0{lora.lora_name}\0{path}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(identity).digest(), "big")


class KVCacheManager:
    """Per-request block tables with prefix caching, forks and copy-on-write."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        prefix_caching_algo: str = "hash",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if prefix_caching_algo not in PREFIX_CACHING_ALGOS:
            raise ValueError(
                f"prefix_caching_algo must be one of {PREFIX_CACHING_ALGOS}, "
                f"got {prefix_caching_algo!r}"
            )
        self.block_size = block_size
        self.prefix_caching_algo = prefix_caching_algo
        use_radix = enable_prefix_caching and prefix_caching_algo == "radix"
        self.radix = RadixCache(page_size=block_size) if use_radix else None
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, self.radix)
        # block table of each request, by request_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # chained hashes of each request's first full blocks, as far as cache_blocks has got
        self.req_to_block_hashes: dict[str, list[int]] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self._block_ids: dict[str, list[int]] = {}  # get_block_ids, until the table changes
        # (src_block_id, dst_block_id) copies made while planning the next step; the scheduler
        # hands them to the model runner in its output (take_copy_on_write)
        self.pending_block_copies: list[tuple[int, int]] = []

    @property
    def num_tokens_capacity(self) -> int:
        """How many tokens' keys and values the whole pool holds."""
        return self.block_pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0 (vLLM's kv_cache_usage_perc)."""
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        Returns the blocks and the number of tokens they hold. The last token is never taken from
        the cache: the model must compute at least one token to produce the logits the next token
        is sampled from. A prompt that is an exact multiple of block_size therefore recomputes its
        whole last block.
        """
        if not self.block_pool.enable_prefix_caching:
            return [], 0
        if self.radix is not None and getattr(request, "lora_request", None) is not None:
            return [], 0  # the radix tree is keyed by tokens alone: adapters do not share it
        token_ids = request.all_token_ids
        num_lookup_blocks = (len(token_ids) - 1) // self.block_size
        if self.radix is not None:
            matched, node = self.radix.match_prefix(
                token_ids[: num_lookup_blocks * self.block_size]
            )
            return self.radix.path_values(node), matched
        computed_blocks: list[KVCacheBlock] = []
        block_hash = root_block_hash(request)
        for i in range(num_lookup_blocks):
            block_tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = hash_block_tokens(block_hash, block_tokens)
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        return computed_blocks, len(computed_blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Grow the request's block table to cover its next `num_new_tokens` tokens.

        `new_computed_blocks` are prefix-cache hits from get_computed_blocks, for a request that
        has no blocks yet: they start its table and count as computed, so the table then covers
        num_computed_tokens + len(new_computed_blocks) * block_size + num_new_tokens tokens.
        A shared block (ref_cnt > 1) that the new tokens would be written into is first replaced
        by a private copy (copy-on-write, see take_copy_on_write). All or nothing: when the pool
        cannot supply every block needed, returns False and changes nothing.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}")
        table = self.req_to_blocks.get(request.request_id)
        if table and not new_computed_blocks:
            # the common case, most decode steps: the new tokens land in blocks the request
            # already holds alone, so there is nothing to allocate and nothing to copy
            first = request.num_computed_tokens // self.block_size
            last = (request.num_computed_tokens + num_new_tokens - 1) // self.block_size
            if last < len(table) and (
                table[last].ref_cnt == 1
                if first == last
                else all(table[i].ref_cnt == 1 for i in range(first, last + 1))
            ):
                return True
        self._block_ids.pop(request.request_id, None)  # the table may change below
        new_computed_blocks = new_computed_blocks or []
        is_new_request = request.request_id not in self.req_to_blocks
        if new_computed_blocks and (not is_new_request or request.num_computed_tokens > 0):
            raise ValueError("new_computed_blocks can only start the table of a new request")
        blocks = self.req_to_blocks.get(request.request_id, [])

        num_computed_tokens = (
            request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        )
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_required_blocks = (num_total_tokens + self.block_size - 1) // self.block_size
        num_missing_blocks = max(num_required_blocks - len(blocks) - len(new_computed_blocks), 0)
        # blocks the new tokens land in that another table also holds (after a fork)
        first_write_block = num_computed_tokens // self.block_size
        shared_indices = [
            i
            for i in range(first_write_block, min(len(blocks), num_required_blocks))
            if blocks[i].ref_cnt > 1
        ]
        # a hit on a free cached block takes it off the free list, using up a free block too
        num_free_hits = sum(block.ref_cnt == 0 for block in new_computed_blocks)
        num_needed = num_missing_blocks + len(shared_indices) + num_free_hits
        if num_needed > self.block_pool.get_num_free_blocks():
            return False

        # counted at admission, not at lookup, so that failed attempts are not counted twice
        if is_new_request and self.block_pool.enable_prefix_caching:
            self.prefix_cache_stats.num_queried_tokens += request.num_tokens
            self.prefix_cache_stats.num_hit_tokens += len(new_computed_blocks) * self.block_size
        # take the hits before allocating, so that allocation cannot evict them
        self.block_pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        block_hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        block_hashes.extend(block.block_hash for block in new_computed_blocks)
        for i in shared_indices:
            self._copy_on_write(blocks, i)
        blocks.extend(self.block_pool.get_new_blocks(num_missing_blocks))
        return True

    def _copy_on_write(self, blocks: list[KVCacheBlock], index: int) -> None:
        """Swap the shared block at `index` of a block table for a private copy."""
        shared_block = blocks[index]
        [private_block] = self.block_pool.get_new_blocks(1)
        self.block_pool.free_blocks([shared_block])
        blocks[index] = private_block
        self.pending_block_copies.append((shared_block.block_id, private_block.block_id))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """After a step, make the request's newly full and computed blocks findable by hash."""
        if not self.block_pool.enable_prefix_caching:
            return
        block_hashes = self.req_to_block_hashes[request.request_id]
        num_full_blocks = num_computed_tokens // self.block_size
        if num_full_blocks <= len(block_hashes):
            return  # no block became full in this step: most decode steps
        blocks = self.req_to_blocks[request.request_id]
        if num_full_blocks > len(blocks):
            raise ValueError(
                f"{num_computed_tokens} computed tokens need {num_full_blocks} blocks, "
                f"but request {request.request_id!r} holds {len(blocks)}"
            )
        token_ids = request.all_token_ids
        if self.radix is not None:
            if getattr(request, "lora_request", None) is None:
                self._insert_into_tree(
                    request.request_id, token_ids, blocks, block_hashes, num_full_blocks
                )
            return
        for i in range(len(block_hashes), num_full_blocks):
            parent_hash = block_hashes[-1] if block_hashes else root_block_hash(request)
            block_tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hashes.append(hash_block_tokens(parent_hash, block_tokens))
            # a block shared with a fork may already be cached through the other request
            if blocks[i].block_hash is None:
                self.block_pool.cache_full_block(blocks[i], block_hashes[-1])

    def _insert_into_tree(
        self,
        request_id: str,
        token_ids: list[int],
        blocks: list[KVCacheBlock],
        num_cached: list[int],
        num_full_blocks: int,
    ) -> None:
        """radix: insert the request's full blocks into the tree. `num_cached` has one entry
        per block already inserted.

        A prefix the tree already holds keeps its blocks (another request computed it at the
        same time), and this request adopts them in place of its own copies, which go back to
        the pool, as SGLang does on insert. That keeps the invariant eviction relies on: the
        tree's blocks a request holds are a path from the root, so every ancestor of a held
        node is held, and a free block in the tree can always be evicted, leaf by leaf. Were
        the copies kept, this request's later blocks would hang below the other request's
        nodes, which could then be free and counted free, yet not evictable."""
        if num_full_blocks <= len(num_cached):
            return
        num_tokens = num_full_blocks * self.block_size
        matched = self.radix.insert(token_ids[:num_tokens], blocks[:num_full_blocks])
        num_matched_blocks = matched // self.block_size
        if num_matched_blocks:
            _, node = self.radix.match_prefix(token_ids[:matched])
            tree_blocks = self.radix.path_values(node)
            for i in range(num_matched_blocks):
                if blocks[i] is not tree_blocks[i]:
                    self.block_pool.touch([tree_blocks[i]])
                    self.block_pool.free_blocks([blocks[i]])
                    blocks[i] = tree_blocks[i]
                    self._block_ids.pop(request_id, None)
        for block in blocks[num_matched_blocks:num_full_blocks]:
            self.block_pool.add_to_tree(block)
        num_cached.extend([0] * (num_full_blocks - len(num_cached)))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Shrink a request's block table to the blocks its first `num_tokens` tokens need;
        the blocks past them go back to the pool (speculative decoding: the slots of rejected
        draft tokens). Those blocks hold no full block of computed tokens, so no prefix-cache
        hash points at them."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        num_kept = -(-num_tokens // self.block_size)
        if num_kept >= len(blocks):
            return
        if num_kept < len(self.req_to_block_hashes.get(request.request_id, ())):
            raise ValueError(
                f"cannot trim request {request.request_id!r} to {num_tokens} tokens: "
                "cached full blocks would go"
            )
        self._block_ids.pop(request.request_id, None)
        dropped = blocks[num_kept:]
        del blocks[num_kept:]
        self.block_pool.free_blocks(reversed(dropped))

    def free(self, request: Request) -> None:
        """Release every block of a request that finished, was aborted, or is preempted.

        The blocks go back last block first, so a request's tail blocks, the least likely to be
        shared as a prefix, are evicted before its head blocks. A request without blocks (aborted
        while waiting) is a no-op.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_hashes.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def fork(self, parent_request: Request, child_request: Request) -> None:
        """Give a new child request the parent's blocks, shared rather than copied (n > 1).

        Each block gains a reference; the first write into a shared block copies it.
        """
        if parent_request.request_id not in self.req_to_blocks:
            raise ValueError(f"cannot fork request {parent_request.request_id!r}: it has no blocks")
        if child_request.request_id in self.req_to_blocks:
            raise ValueError(f"fork child {child_request.request_id!r} already has blocks")
        parent_blocks = self.req_to_blocks[parent_request.request_id]
        self.block_pool.touch(parent_blocks)
        self.req_to_blocks[child_request.request_id] = list(parent_blocks)
        parent_hashes = self.req_to_block_hashes[parent_request.request_id]
        self.req_to_block_hashes[child_request.request_id] = list(parent_hashes)

    def take_copy_on_write(self) -> list[tuple[int, int]]:
        """The (src_block_id, dst_block_id) copies made since the last call, in order.

        The scheduler puts them into its output; the model runner copies every layer's keys
        and values from src to dst before the forward, which writes new tokens into dst.
        """
        copies, self.pending_block_copies = self.pending_block_copies, []
        return copies

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (kept until the table changes: read it, do
        not modify it)."""
        block_ids = self._block_ids.get(request_id)
        if block_ids is None:
            block_ids = [block.block_id for block in self.req_to_blocks[request_id]]
            self._block_ids[request_id] = block_ids
        return block_ids
