"""Radix cache: a prefix cache at token granularity, as in SGLang's RadixAttention.

The cache is a radix tree (a trie whose edges carry spans of tokens rather than single
tokens). Every path from the root spells a token sequence whose keys and values are resident;
two sequences that share a prefix share the nodes of that prefix, so the prefix is stored once.
In SGLang each node also holds the KV-cache slot of each of its tokens; here the tree is the
index alone, which is all that decides what a request can reuse.

- `match_prefix(tokens)`: the longest cached prefix of `tokens`, to any token boundary (a
  block-hashing cache such as minillm's `BlockPool` can only stop at a block boundary).
- `insert(tokens, value)`: make a whole sequence resident, sharing what is already there.
- `inc_lock_ref` / `dec_lock_ref`: a running request locks the path it uses, so eviction
  cannot take tokens from under it.
- `evict(num_tokens)`: free memory by removing unlocked leaves, least recently used first. A
  leaf goes first because an inner node is a prefix of something else: removing it would orphan
  its children.

With `page_size` > 1 the tree matches and splits at page boundaries only, and each node holds
one value per page of its span: this is how the engine uses it (`prefix_caching_algo="radix"`),
with pages of `block_size` tokens whose values are the KV-cache blocks that hold them, as SGLang
does when its KV pool is paged.

Zheng et al., 2024, "SGLang: Efficient Execution of Structured Language Model Programs".
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class RadixNode:
    """A node of the tree: the span of tokens on the edge from its parent."""

    key: tuple[int, ...]
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)  # by their key's first token
    # running requests whose matched path passes through this node; > 0 means not evictable
    lock_ref: int = 0
    last_access: int = 0  # logical time of the last match or insert that touched the node
    value: list = field(default_factory=list)  # one item per page of `key`, when given


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class RadixCache:
    """A prefix cache as a radix tree: match, insert, lock, and evict unlocked leaves by LRU."""

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.page_size = page_size
        self.root = RadixNode(())
        self.num_cached_tokens = 0  # tokens on all edges: the KV the tree keeps resident
        self._clock = itertools.count(1)

    def _child_key(self, token_ids: Sequence[int]) -> int | tuple[int, ...]:
        """Children are found by their first token, or by their first page when paged."""
        return token_ids[0] if self.page_size == 1 else tuple(token_ids[: self.page_size])

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[int, RadixNode]:
        """The length of the longest cached prefix of `token_ids`, and the node it ends at.

        When the match ends inside a node's span, the node is split there, so that the node
        returned spells exactly the matched prefix and can be locked. Splitting changes the
        tree's shape, never what it caches. Every node on the path counts as used now (LRU).
        With pages, only whole pages match.
        """
        now = next(self._clock)
        node = self.root
        node.last_access = now
        matched = 0
        while len(token_ids) - matched >= self.page_size:
            child = node.children.get(self._child_key(token_ids[matched:]))
            if child is None:
                break
            n = common_prefix_len(child.key, token_ids[matched:])
            n -= n % self.page_size
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node = child
            matched += n
        return matched, node

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node`'s span after n tokens; returns the new upper node (its first n tokens)."""
        parent = node.parent
        assert parent is not None, "the root has no span to split"
        num_pages = n // self.page_size
        upper = RadixNode(
            node.key[:n],
            parent=parent,
            children={self._child_key(node.key[n:]): node},
            lock_ref=node.lock_ref,  # every lock through node passes through its prefix too
            last_access=node.last_access,
            value=node.value[:num_pages],
        )
        parent.children[self._child_key(node.key)] = upper
        node.key = node.key[n:]
        node.value = node.value[num_pages:]
        node.parent = upper
        return upper

    def insert(self, token_ids: Sequence[int], value: Sequence | None = None) -> int:
        """Make `token_ids` resident (whole pages of it), with `value[i]` for page i when
        given. Returns how many of its leading tokens already were; their values stay."""
        num_tokens = len(token_ids) - len(token_ids) % self.page_size
        token_ids = token_ids[:num_tokens]
        matched, node = self.match_prefix(token_ids)
        if matched < num_tokens:
            leaf = RadixNode(
                tuple(token_ids[matched:]),
                parent=node,
                last_access=node.last_access,
                value=list(value[matched // self.page_size :]) if value is not None else [],
            )
            node.children[self._child_key(leaf.key)] = leaf
            self.num_cached_tokens += len(leaf.key)
        return matched

    def path_values(self, node: RadixNode) -> list:
        """The values of every page from the root down to `node`, in order."""
        values = []
        while node is not self.root:
            values[:0] = node.value
            node = node.parent
        return values

    def inc_lock_ref(self, node: RadixNode) -> None:
        """Protect the path from the root to `node` (a request is using those tokens)."""
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: RadixNode) -> None:
        """Release a lock taken with inc_lock_ref on the same node."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        if any(n.lock_ref < 1 for n in path):
            raise ValueError("dec_lock_ref on a path that is not locked")
        for n in path:
            n.lock_ref -= 1

    def evictable_tokens(self) -> int:
        """Tokens on nodes that no lock protects: what evict can free."""
        return sum(len(n.key) for n in self._nodes() if n.lock_ref == 0)

    def evict(
        self,
        num_tokens: int,
        can_evict: Callable[[RadixNode], bool] | None = None,
        on_evict: Callable[[RadixNode], None] | None = None,
    ) -> int:
        """Remove unlocked leaves, least recently used first, until at least `num_tokens` tokens
        are freed or nothing unlocked is left. Returns the number of tokens freed.

        A parent whose last child goes becomes a leaf and joins the candidates, so a whole
        unused branch can go, tail first. `can_evict` replaces the lock test (the engine asks
        whether a node's blocks are free); `on_evict` sees each node removed.
        """
        can_evict = can_evict or (lambda node: node.lock_ref == 0)
        order = itertools.count()  # ties in last_access: first found, first evicted
        heap = [
            (n.last_access, next(order), n)
            for n in self._nodes()
            if not n.children and can_evict(n)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            self.num_cached_tokens -= len(leaf.key)
            freed += len(leaf.key)
            if on_evict is not None:
                on_evict(leaf)
            if parent is not self.root and not parent.children and can_evict(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def cached_sequences(self) -> list[tuple[int, ...]]:
        """Every root-to-leaf path: the longest resident sequences (for tests and figures)."""
        sequences = []
        stack: list[tuple[RadixNode, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key
            if not node.children and node is not self.root:
                sequences.append(path)
            stack.extend((child, path) for child in node.children.values())
        return sorted(sequences)

    def _nodes(self) -> list[RadixNode]:
        """Every node but the root."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
