"""Chapter 3's diagrams draw what the engine holds: head counts, block tables, reference
counts, the free list, chained hashes and radix-tree nodes, read back from the canvas."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minillm.core.block_pool import hash_block_tokens  # noqa: E402
from minillm.core.kv_cache_manager import KVCacheManager  # noqa: E402
from minillm.core.radix_cache import RadixCache  # noqa: E402
from minillm.core.request import Request  # noqa: E402
from minillm.lab import kv_memory  # noqa: E402
from minillm.lab.catalog import get_model_config  # noqa: E402
from minillm.lab.diagrams import paging  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=4), arrival_time=0.0)


def admit(manager: KVCacheManager, request: Request) -> None:
    """What the scheduler does for a new request: look up its prefix, allocate, compute."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


# -- head sharing --------------------------------------------------------------------------


def test_head_sharing_draws_the_configs_head_counts_and_groups():
    rows = paging.head_sharing_variants("Llama 3.3 70B")
    config = get_model_config("Llama 3.3 70B")
    canvas = paging.draw_head_sharing(rows)
    assert [r.attention for r in rows] == ["MHA", "GQA", "MQA", "MLA"]
    assert len(canvas.parts("query:GQA")) == config.num_attention_heads == 64
    assert len(canvas.parts("cached:GQA")) == config.num_key_value_heads == 8
    assert len(canvas.parts("cached:MHA")) == 64
    assert canvas.parts("cached:MQA") == ["kv0"]
    assert canvas.parts("cached:MLA") == ["latent", "rope key"]
    assert len(canvas.parts("query:MLA")) == kv_memory.DEEPSEEK_V3_CONFIG["num_attention_heads"]
    # query head h of a group of g reads KV head h // g
    group = config.num_attention_heads // config.num_key_value_heads
    gqa_links = [(q, kv) for q, kv in canvas.links if q.startswith("q") and kv.startswith("kv")]
    assert (f"q{group * 3 + 1}", "kv3") in gqa_links
    assert (f"q{group * 3 + 1}", "kv2") not in gqa_links


def test_head_sharing_writes_the_bytes_kv_memory_computes():
    rows = paging.head_sharing_variants("Llama 3.1 8B")
    canvas = paging.draw_head_sharing(rows)
    llama = kv_memory.get_kv_layout("Llama 3.1 8B")
    gqa_label = paging.kib_label(kv_memory.kv_bytes_per_token(llama))
    assert canvas.parts("bytes:GQA") == [gqa_label] and gqa_label in canvas.labels()
    assert gqa_label.startswith("128 KiB")
    assert canvas.parts("bytes:MHA") == [paging.kib_label(4 * kv_memory.kv_bytes_per_token(llama))]
    mla = kv_memory.get_kv_layout("DeepSeek V3")
    assert canvas.parts("bytes:MLA") == [paging.kib_label(kv_memory.kv_bytes_per_token(mla))]
    assert "latent c_KV: 512" in canvas.labels()


# -- the block pool -------------------------------------------------------------------------


def pool_state():
    """A allocated, D allocated and freed, C sharing A's first two blocks, B on its own."""
    manager = KVCacheManager(num_blocks=12, block_size=4)
    a = make_request("A", list(range(10)))
    d = make_request("D", [90, 91, 92, 93, 94])
    admit(manager, d)
    admit(manager, a)
    manager.free(d)
    b = make_request("B", [50, 51, 52])
    c = make_request("C", list(range(8)) + [70, 71])
    admit(manager, b)
    admit(manager, c)
    tables = {r: manager.get_block_ids(r) for r in ("A", "B", "C")}
    return manager, tables


def test_block_pool_diagram_shows_the_pools_ids_refs_and_free_list():
    manager, tables = pool_state()
    pool = manager.block_pool
    canvas = paging.draw_block_pool(pool, tables, block_size=4)
    assert canvas.parts("physical") == [
        paging.block_label(b.block_id, b.ref_cnt) for b in pool.blocks
    ]
    assert canvas.parts("free list") == [str(i) for i in pool.free_block_queue]
    for request_id, table in tables.items():
        assert canvas.parts(f"table:{request_id}") == [str(i) for i in table]
        assert canvas.parts(f"logical:{request_id}") == [str(i) for i in range(len(table))]
    # C found A's first two blocks: both tables point there, and each has two references
    shared = tables["A"][:2]
    assert tables["C"][:2] == shared
    assert paging.block_label(shared[0], 2) in canvas.labels()
    assert f"{shared[1]}: A1 C1" in canvas.parts("owners")
    # D's blocks went back to the tail of the free list, last block first
    assert canvas.parts("free list")[-2:] == ["1", "0"]


def test_block_pool_diagram_changes_with_the_pool():
    manager, tables = pool_state()
    before = paging.draw_block_pool(manager.block_pool, tables, block_size=4)
    c = make_request("C", [])
    manager.free(c)  # C leaves: the shared blocks drop to one reference
    del tables["C"]
    after = paging.draw_block_pool(manager.block_pool, tables, block_size=4)
    shared = tables["A"][0]
    assert paging.block_label(shared, 2) in before.parts("physical")
    assert paging.block_label(shared, 1) in after.parts("physical")
    assert len(after.parts("free list")) == len(before.parts("free list")) + 1


def test_block_pool_diagram_refuses_a_pool_too_large_to_read():
    with pytest.raises(ValueError, match="too large"):
        paging.draw_block_pool(KVCacheManager(num_blocks=100).block_pool, {})


# -- chained hashes ---------------------------------------------------------------------------


def test_hash_chain_draws_the_managers_hashes_and_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    same, fourth = [1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 43]
    a = make_request("A", same + [9, 9, 9, 9] + fourth + [0])
    b = make_request("B", same + [8, 8, 8, 8] + fourth + [0])
    admit(manager, a)
    admit(manager, b)
    canvas = paging.draw_block_hashes(manager, ["A", "B"])
    for r in ("A", "B"):
        assert canvas.parts(f"hash:{r}") == [
            paging.short_hash(h) for h in manager.req_to_block_hashes[r]
        ]
        num_full = len(manager.req_to_block_hashes[r])  # only full blocks have a hash
        assert num_full == 4
        assert canvas.parts(f"block:{r}") == [str(i) for i in manager.get_block_ids(r)[:num_full]]
    hashes_a, hashes_b = canvas.parts("hash:A"), canvas.parts("hash:B")
    assert hashes_a[:2] == hashes_b[:2] and hashes_a[2] != hashes_b[2]
    # the same tokens after a different block: a different hash
    assert hashes_a[3] != hashes_b[3]
    parent = manager.req_to_block_hashes["A"][2]
    assert hashes_a[3] == paging.short_hash(hash_block_tokens(parent, fourth))


# -- the radix tree -------------------------------------------------------------------------------


def tree_nodes(cache: RadixCache):
    """(parent label, child label) of every edge, labels as the diagram writes them."""
    edges, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            parent_label = "root" if node is cache.root else paging.radix_node_label(node, None)
            edges.append((parent_label, paging.radix_node_label(child, None)))
            stack.append(child)
    return edges


def test_radix_diagram_draws_every_node_and_edge_of_the_tree():
    cache = RadixCache()
    system = list(range(100, 120))
    cache.insert(system + [1, 2, 3])
    cache.insert(system + [1, 2, 4, 5])
    cache.insert(system + [7])
    cache.insert([200, 201])
    canvas = paging.draw_radix_tree(cache)
    expected = tree_nodes(cache)
    assert sorted(canvas.links) == sorted(expected)
    assert len(canvas.parts("node")) == len(expected) == 6
    assert "20 tokens" in canvas.parts("node")  # the shared system prompt, stored once
    assert canvas.parts("root") == ["root"]
    cache.insert(system + [1, 2, 3, 9])  # a longer answer: one more node
    assert len(paging.draw_radix_tree(cache).parts("node")) == 7


def test_radix_diagram_names_the_blocks_of_the_engines_paged_tree():
    manager = KVCacheManager(num_blocks=16, block_size=4, prefix_caching_algo="radix")
    a = make_request("A", list(range(12)) + [0])
    b = make_request("B", list(range(8)) + [50, 51, 52, 53, 0])
    admit(manager, a)
    admit(manager, b)
    canvas = paging.draw_radix_tree(manager.radix)
    shared = manager.get_block_ids("A")[:2]
    assert f"8 tokens\nblocks {shared[0]},{shared[1]}" in canvas.parts("node")
    assert manager.get_block_ids("B")[:2] == shared
    assert len(canvas.parts("node")) == 3
