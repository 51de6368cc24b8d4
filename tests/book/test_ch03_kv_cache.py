"""The checks of the KV-cache exercises reject plausible wrong answers.

As in test_ch00_conventions.py, the check cells run in this process: the solution's cells
define the functions, then each graded cell runs once with the solution (it must pass), once
with the stub (NotImplementedError), and once per wrong answer (it must fail).
"""

from __future__ import annotations

import math
from collections import deque

import torch

from minillm.core.block_pool import hash_block_tokens

from .conftest import ROOT
from .exercise_checks import ExerciseChecks, FromNamespace

# -- wrong block allocators ---------------------------------------------------------------


class HandsOutTwice:
    """Allocates without taking blocks out of the free list."""

    def __init__(self, num_blocks):
        self.num_blocks, self.num_used = num_blocks, 0

    @property
    def num_free_blocks(self):
        return self.num_blocks - self.num_used

    def allocate(self, n):
        if n > self.num_free_blocks:
            raise ValueError("full")
        self.num_used += n
        return list(range(n))

    def free(self, block_ids):
        self.num_used -= len(block_ids)


class Leaks:
    """free() forgets to give the blocks back."""

    def __init__(self, num_blocks):
        self.free_ids, self.used = deque(range(num_blocks)), set()

    @property
    def num_free_blocks(self):
        return len(self.free_ids)

    def allocate(self, n):
        if n > len(self.free_ids):
            raise ValueError("full")
        ids = [self.free_ids.popleft() for _ in range(n)]
        self.used.update(ids)
        return ids

    def free(self, block_ids):
        if not self.used.issuperset(block_ids):
            raise ValueError("not allocated")
        self.used.difference_update(block_ids)


class Overcommits(Leaks):
    """Hands out what it has when asked for more, instead of refusing."""

    def allocate(self, n):
        ids = [self.free_ids.popleft() for _ in range(min(n, len(self.free_ids)))]
        self.used.update(ids)
        return ids

    def free(self, block_ids):
        self.used.difference_update(block_ids)
        self.free_ids.extend(block_ids)


class AcceptsDoubleFree(Leaks):
    """Does not check that freed blocks were allocated."""

    def free(self, block_ids):
        self.used.difference_update(block_ids)
        self.free_ids.extend(block_ids)


class NoDuplicateCheck(Leaks):
    """Checks each id but not that an id is named only once."""

    def free(self, block_ids):
        if not self.used.issuperset(block_ids):
            raise ValueError("not allocated")
        self.used.difference_update(block_ids)
        self.free_ids.extend(block_ids)


class FreesThenRaises(Leaks):
    """Frees the valid ids one by one and raises at the first bad one: a partial free."""

    def free(self, block_ids):
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("duplicate")
        for block in block_ids:
            if block not in self.used:
                raise ValueError("not allocated")
            self.used.remove(block)
            self.free_ids.append(block)


# -- other wrong answers ------------------------------------------------------------------


def unchained_hashes(token_ids, block_size):
    n = len(token_ids) // block_size
    return [
        hash_block_tokens(None, token_ids[i * block_size : (i + 1) * block_size]) for i in range(n)
    ]


def hashes_with_partial_block(token_ids, block_size):
    hashes, parent = [], None
    for start in range(0, len(token_ids), block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def lookup(stop_at_miss: bool, drop_last: bool):
    def num_cached_tokens(token_ids, cached_hashes, block_size):
        tokens = token_ids[:-1] if drop_last else token_ids
        n = len(tokens) // block_size
        count, parent = 0, None
        for i in range(n):
            parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
            if parent in cached_hashes:
                count += 1
            elif stop_at_miss:
                break
        return count * block_size

    return num_cached_tokens


def fork_without_refs(table, ref_cnt):
    return list(table)


def write(copy_when: str, drop_ref: bool = True, returns: str = "shared, new"):
    """prepare_write that copies never, always, or when shared; optionally keeping the ref;
    returning the copy as (shared, new), the wrong way round, or (0, 0)."""

    def prepare_write(table, pos, ref_cnt, free_list, block_size):
        if pos % block_size == 0:
            block = free_list.popleft()
            ref_cnt[block] = 1
            table.append(block)
            return None
        index = pos // block_size
        shared = table[index]
        copy = {"never": False, "always": True, "shared": ref_cnt[shared] > 1}[copy_when]
        if not copy:
            return None
        new = free_list.popleft()
        ref_cnt[new] = 1
        if drop_ref:
            ref_cnt[shared] -= 1
        table[index] = new
        return {"shared, new": (shared, new), "new, shared": (new, shared), "0, 0": (0, 0)}[returns]

    return prepare_write


def free_list(order: str):
    def free_list_order(num_blocks, events):
        ref_cnt, free = [1] * num_blocks, []
        for kind, ids in events:
            for block in ids:
                if kind == "free":
                    ref_cnt[block] -= 1
                    if order == "ignore refs" or ref_cnt[block] == 0:
                        if block not in free:
                            free.append(block)
                else:
                    if ref_cnt[block] == 0 and order != "hits stay":
                        free.remove(block)
                    ref_cnt[block] += 1
        if order == "lifo":
            return free[::-1]
        if order == "by id":
            return sorted(free)
        return free

    return free_list_order


def fp8_with(scale_of, use_given=True):
    def fp8_quantize(x, scale=None):
        if scale is None or not use_given:
            scale = scale_of(x.abs().max().item())
        scaled = x.float() / scale
        return scaled.clamp(-448, 448).to(torch.float8_e4m3fn), scale

    return fp8_quantize


def sequences(window: str, rounding=math.floor):
    def sequences_that_fit(kv_pool_bytes, layout, seq_len, dtype_bytes):
        if window == "ignored" or layout.sliding_window is None:
            cached = layout.num_layers * seq_len
        elif window == "all layers":
            cached = layout.num_layers * min(seq_len, layout.sliding_window)
        else:
            cached = layout.num_full_layers * seq_len + layout.num_sliding_layers * min(
                seq_len, layout.sliding_window
            )
        result = kv_pool_bytes / (cached * layout.values_per_layer * dtype_bytes)
        return result if rounding is None else int(rounding(result))

    return sequences_that_fit


def evict_with(
    locks=True,
    lru=True,
    parents=True,
    parents_ordered=True,
    parent_lock=True,
    whole=True,
    overshoot=True,
    count_nodes=False,
    update_count=True,
):
    """The solution's evict with one mistake."""

    def evict(cache, num_tokens):
        candidates, stack = [], list(cache.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and (node.lock_ref == 0 or not locks):
                candidates.append(node)
        if not parents_ordered:  # sorted once; parents join at the end
            candidates.sort(key=lambda n: n.last_access)
        freed = 0
        while (freed < num_tokens or not whole) and candidates:
            if parents_ordered:
                pick = min if lru else max
                leaf = pick(candidates, key=lambda n: n.last_access)
            else:
                leaf = candidates[0]
            if not overshoot and freed + len(leaf.key) > num_tokens:
                break
            candidates.remove(leaf)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if update_count:
                cache.num_cached_tokens -= len(leaf.key)
            freed += 1 if count_nodes else len(leaf.key)
            if (
                parents
                and parent is not cache.root
                and not parent.children
                and (parent.lock_ref == 0 or not parent_lock)
            ):
                candidates.append(parent)
        return freed

    return evict


def preemption(count: str):
    """measure_preemption that reports the wrong token count; needs the notebook's globals."""

    def measure(namespace):
        def measure_preemption(num_gpu_blocks):
            engine = namespace["make_engine"](num_gpu_blocks)
            prompts, params = namespace["PROMPTS"], namespace["PARAMS"]
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            outputs = {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        outputs[output.request_id] = output.outputs[0].token_ids
            ran = sum(engine.stats.num_batched_tokens)
            if count == "all output tokens":
                ran -= sum(len(p) + params.max_tokens for p in prompts)
            return engine.stats.num_preemptions, ran, outputs

        return measure_preemption

    return FromNamespace(measure)


WRONG_ANSWERS = {
    "kv_bytes_per_token": {
        "no factor 2": lambda L, H, K, D, b: L * K * D * b,
        "query heads": lambda L, H, K, D, b: 2 * L * H * D * b,
        "bits": lambda L, H, K, D, b: 16 * L * K * D * b,
        "one layer": lambda L, H, K, D, b: 2 * K * D * b,
    },
    "mla_bytes_per_token": {
        "separate latents": lambda L, H, r, p, b: L * (2 * r + p) * b,
        "factor 2": lambda L, H, r, p, b: 2 * L * (r + p) * b,
        "no rope key": lambda L, H, r, p, b: L * r * b,
        "per head": lambda L, H, r, p, b: H * L * (r + p) * b,
    },
    "sequences_that_fit": {
        "window ignored": sequences("ignored"),
        "window on every layer": sequences("all layers"),
        "rounded up": sequences("right", math.ceil),
        "not rounded": sequences("right", None),
    },
    "BlockAllocator": {
        "hands out twice": HandsOutTwice,
        "leaks": Leaks,
        "overcommits": Overcommits,
        "accepts a double free": AcceptsDoubleFree,
        "accepts a block named twice in one free": NoDuplicateCheck,
        "frees the valid ids before raising": FreesThenRaises,
    },
    "block_hashes": {
        "unchained": unchained_hashes,
        "partial block hashed": hashes_with_partial_block,
    },
    "num_cached_tokens": {
        "does not stop at a miss": lookup(stop_at_miss=False, drop_last=True),
        "looks up the last token": lookup(stop_at_miss=True, drop_last=False),
    },
    "fork": {"no references taken": fork_without_refs},
    "prepare_write": {
        "never copies": write("never"),
        "always copies": write("always"),
        "keeps the shared reference": write("shared", drop_ref=False),
        "copy the wrong way round": write("shared", returns="new, shared"),
        "a made-up copy": write("shared", returns="0, 0"),
    },
    "free_list_order": {
        "newest first": free_list("lifo"),
        "by id": free_list("by id"),
        "ignores reference counts": free_list("ignore refs"),
        "hits stay in the list": free_list("hits stay"),
    },
    "break_even_bandwidth": {
        "inverted": lambda b, f, p, m: f / (b * p * m),
        "peak, not sustained": lambda b, f, p, m: b * p / f,
        "bits": lambda b, f, p, m: 8 * b * p * m / f,
    },
    "fp8_quantize": {
        "inverted scale": fp8_with(lambda amax: 448 / amax if amax else 1.0),
        "int8 range": fp8_with(lambda amax: amax / 127 if amax else 1.0),
        "e4m3fnuz range": fp8_with(lambda amax: amax / 240 if amax else 1.0),
        "scale 1": fp8_with(lambda amax: 1.0),
        "given scale ignored": fp8_with(lambda amax: amax / 448 if amax else 1.0, use_given=False),
    },
    "measure_preemption": {
        "all tokens run": preemption("all tokens"),
        "all output tokens": preemption("all output tokens"),
    },
    "evict": {
        "locks ignored": evict_with(locks=False),
        "most recently used first": evict_with(lru=False),
        "parents never become candidates": evict_with(parents=False),
        "parents join behind newer leaves": evict_with(parents_ordered=False),
        "a locked parent becomes a candidate": evict_with(parent_lock=False),
        "every unlocked leaf goes": evict_with(whole=False),
        "never frees more than asked": evict_with(overshoot=False),
        "counts nodes, not tokens": evict_with(count_nodes=True),
        "num_cached_tokens not updated": evict_with(update_count=False),
        "cache.evict called": lambda cache, n: cache.evict(n),
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch03_kv_cache.ipynb"
    EXERCISE = ROOT / "exercises" / "ch03_kv_cache.ipynb"
    POINTS = [2, 2, 3, 3, 3, 2, 2, 2, 2, 4]
    WRONG_ANSWERS = WRONG_ANSWERS
