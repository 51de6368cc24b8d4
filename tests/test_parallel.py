"""The parallelism calculators against independent derivations.

Oracles that share no code with minillm.lab.parallel and minillm.lab.interconnect: collectives
simulated chunk by chunk (a ring all-reduce, a binary tree, an all-gather), a GPipe schedule
laid out slot by slot, tokens routed to experts one by one, a tensor-parallel layer computed
shard by shard in plain PyTorch, the KV tensors transformers keeps for a prompt, and the
seeds' worked figures.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab import collective_bench, interconnect, parallel, roofline
from minillm.lab.catalog import get_model_config, model_names
from minillm.lab.hardware import get_device
from minillm.model.loader import DEFAULT_MODEL, load_model

LINK = interconnect.Link(
    "test link", bandwidth_bytes_per_s=1e9, latency_s=1e-5, source="", source_date=""
)
FAST = interconnect.Link(
    "no cost", bandwidth_bytes_per_s=1e30, latency_s=0.0, source="", source_date=""
)


# -- collectives, simulated ---------------------------------------------------------------


def simulate_ring_all_reduce(values: list[list[float]]) -> tuple[list[list[float]], int, float]:
    """A ring all-reduce of p equal-length vectors, chunk by chunk.

    Returns the results, the number of steps, and the elements each rank sent."""
    p, n = len(values), len(values[0])
    bounds = [(c * n // p, (c + 1) * n // p) for c in range(p)]
    data = [list(v) for v in values]
    sent = [0] * p
    steps = 0
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            messages = []
            for r in range(p):
                c = (r - s) % p if phase == "reduce-scatter" else (r + 1 - s) % p
                lo, hi = bounds[c]
                messages.append(((r + 1) % p, c, data[r][lo:hi]))
                sent[r] += hi - lo
            for dst, c, chunk in messages:
                lo, hi = bounds[c]
                if phase == "reduce-scatter":
                    data[dst][lo:hi] = [a + b for a, b in zip(data[dst][lo:hi], chunk, strict=True)]
                else:
                    data[dst][lo:hi] = chunk
            steps += 1
    return data, steps, max(sent)


@given(st.integers(2, 9), st.integers(1, 6))
def test_ring_all_reduce_matches_a_simulated_ring(p, chunk):
    n = p * chunk
    values = [[float(r * 100 + i) for i in range(n)] for r in range(p)]
    result, steps, sent = simulate_ring_all_reduce(values)
    expected = [sum(v[i] for v in values) for i in range(n)]
    assert all(row == expected for row in result)  # the simulation is an all-reduce
    elem = 4
    assert parallel_bytes(n * elem, p) == pytest.approx(sent * elem)
    assert interconnect.all_reduce_time_s(n * elem, p, LINK) == pytest.approx(
        steps * LINK.latency_s + sent * elem / LINK.bandwidth_bytes_per_s
    )


def parallel_bytes(num_bytes, p):
    return interconnect.ring_all_reduce_bytes_per_rank(num_bytes, p)


def simulate_tree(p: int) -> int:
    """Levels of a binary-tree reduce: pairs combine until one rank holds the sum."""
    alive, levels = list(range(p)), 0
    while len(alive) > 1:
        alive = alive[::2]
        levels += 1
    return levels


@given(st.integers(1, 64), st.integers(0, 10**7))
def test_tree_all_reduce_is_reduce_then_broadcast_of_the_whole_message(p, n):
    levels = simulate_tree(p)
    expected = 0.0 if p == 1 else 2 * levels * (LINK.latency_s + n / LINK.bandwidth_bytes_per_s)
    assert interconnect.all_reduce_time_s(n, p, LINK, "tree") == pytest.approx(expected)


@given(st.integers(3, 64))
def test_crossover_is_where_ring_and_tree_cost_the_same(p):
    n = interconnect.all_reduce_crossover_bytes(p, LINK)
    ring = interconnect.all_reduce_time_s(n, p, LINK, "ring")
    tree = interconnect.all_reduce_time_s(n, p, LINK, "tree")
    if n > 0:
        assert ring == pytest.approx(tree)
        assert interconnect.all_reduce_time_s(
            n / 2, p, LINK, "tree"
        ) < interconnect.all_reduce_time_s(n / 2, p, LINK)
    assert interconnect.all_reduce_time_s(2 * n + 1e6, p, LINK) < interconnect.all_reduce_time_s(
        2 * n + 1e6, p, LINK, "tree"
    )


@given(st.integers(2, 9), st.integers(1, 5))
def test_all_gather_matches_a_simulated_ring(p, chunk):
    # each rank forwards the chunk it received last step: p - 1 steps of one chunk
    have = [{r} for r in range(p)]
    last = list(range(p))
    steps = sent = 0
    while any(len(h) < p for h in have):
        last = [last[(r - 1) % p] for r in range(p)]
        for r in range(p):
            have[r].add(last[r])
        steps += 1
        sent += chunk
    gathered = p * chunk
    assert interconnect.all_gather_time_s(gathered, p, LINK) == pytest.approx(
        steps * LINK.latency_s + sent / LINK.bandwidth_bytes_per_s
    )
    assert interconnect.reduce_scatter_time_s(gathered, p, LINK) == pytest.approx(
        interconnect.all_gather_time_s(gathered, p, LINK)
    )


def test_an_all_reduce_is_a_reduce_scatter_then_an_all_gather():
    n = 3 * 2**20
    for p in (2, 4, 8):
        rs_ag = interconnect.reduce_scatter_time_s(n, p, LINK) + interconnect.all_gather_time_s(
            n, p, LINK
        )
        assert interconnect.all_reduce_time_s(n, p, LINK) == pytest.approx(rs_ag)


def test_link_catalog_is_the_datasheets_per_direction():
    nvlink = interconnect.get_link("nvlink 4 (h100/h200 sxm)")
    assert nvlink.bandwidth_bytes_per_s == 450e9  # 900 GB/s is both directions
    assert interconnect.get_link("PCIe Gen5 x16").bandwidth_bytes_per_s == pytest.approx(
        32e9 * 16 * 128 / 130 / 8
    )
    assert interconnect.get_link("PCIe Gen4 x16").bandwidth_bytes_per_s == pytest.approx(
        31.5e9, rel=1e-3
    )
    with pytest.raises(ValueError, match="unknown link"):
        interconnect.get_link("NVLink 9")
    with pytest.raises(ValueError, match="num_ranks"):
        interconnect.all_reduce_time_s(1, 0, LINK)
    with pytest.raises(ValueError, match="algorithm"):
        interconnect.all_reduce_time_s(1, 2, LINK, "butterfly")
    with pytest.raises(ValueError, match="bandwidth"):
        interconnect.Link("bad", 0, 1e-6, "", "")


# -- tensor parallelism -------------------------------------------------------------------


def test_all_reduces_per_step_count_the_row_parallel_layers_of_a_real_model():
    model = load_model(DEFAULT_MODEL)
    row_parallel = [
        n for n, _ in model.model.named_modules() if n.endswith(("o_proj", "down_proj"))
    ]
    assert parallel.tp_all_reduces_per_step(model.config, vocab_parallel_embedding=False) == len(
        row_parallel
    )
    assert parallel.tp_all_reduces_per_step(model.config) == len(row_parallel) + 1
    # the seeds' figure: Llama 3.3 70B runs 160 all-reduces per decode step (80 layers)
    assert parallel.tp_all_reduces_per_step(get_model_config("Llama 3.3 70B"), False) == 160


def test_a_sharded_layer_reduces_partial_sums_of_the_hidden_size():
    torch.manual_seed(0)
    model = load_model(DEFAULT_MODEL, dtype="float32")
    mlp = model.model.model.layers[0].mlp
    tp, tokens = 2, 5
    x = torch.randn(tokens, model.config.hidden_size, dtype=mlp.down_proj.weight.dtype)
    inter = model.config.intermediate_size // tp
    partials = []
    for r in range(tp):  # gate/up split by output column, down by input row
        cols = slice(r * inter, (r + 1) * inter)
        h = torch.nn.functional.silu(x @ mlp.gate_proj.weight[cols].T) * (
            x @ mlp.up_proj.weight[cols].T
        )
        partials.append(h @ mlp.down_proj.weight[:, cols].T)
    torch.testing.assert_close(sum(partials), mlp(x), rtol=1e-5, atol=1e-5)
    one = partials[0]
    assert (
        parallel.tp_all_reduce_bytes(model.config, tokens, "float32")
        == one.numel() * one.element_size()
    )


def test_tp_communication_is_count_times_one_all_reduce():
    c = get_model_config("Llama 3.3 70B")
    link = interconnect.get_link("PCIe Gen4 x16")
    n = 64 * 8192 * 2
    one = 2 * 7 * link.latency_s + 2 * 7 / 8 * n / link.bandwidth_bytes_per_s
    assert parallel.tp_communication_time_s(c, 64, 8, link) == pytest.approx(161 * one)
    assert parallel.tp_communication_time_s(c, 64, 1, link) == 0.0


@given(st.integers(1, 64), st.integers(0, 6))
def test_kv_heads_per_rank_matches_a_head_assignment(kv_heads, log_tp):
    tp = 2**log_tp
    if (tp <= kv_heads and kv_heads % tp) or (tp > kv_heads and tp % kv_heads):
        with pytest.raises(ValueError):
            parallel.kv_heads_per_rank(kv_heads, tp)
        return
    # H = kv_heads * tp query heads, split into tp contiguous ranges; query head q reads
    # KV head q // (H / kv_heads)
    heads = kv_heads * tp
    group = heads // kv_heads
    per_rank = heads // tp
    needed = [{q // group for q in range(r * per_rank, (r + 1) * per_rank)} for r in range(tp)]
    assert {len(s) for s in needed} == {parallel.kv_heads_per_rank(kv_heads, tp)}


def test_bad_tensor_parallel_sizes_are_refused():
    c = get_model_config("Llama 3.1 8B")
    with pytest.raises(ValueError, match="attention heads"):
        parallel.check_tensor_parallel(c, 3)
    with pytest.raises(ValueError, match="multiple of the 8 KV heads"):
        parallel.kv_heads_per_rank(8, 12)
    with pytest.raises(ValueError, match="tp must be an int"):
        parallel.check_tensor_parallel(c, 0)


# -- pipeline parallelism -----------------------------------------------------------------


@given(st.integers(1, 12), st.integers(1, 24))
def test_bubble_matches_a_gpipe_schedule_slot_by_slot(p, m):
    busy = {(s, s + j) for s in range(p) for j in range(m)}  # stage s runs micro-batch j at s + j
    slots = max(t for _, t in busy) + 1
    idle = p * slots - len(busy)
    assert parallel.pipeline_bubble_fraction(p, m) == pytest.approx(idle / (p * slots))


@given(st.integers(1, 100), st.integers(1, 16))
def test_stage_layers_cover_the_model_evenly(layers, stages):
    if stages > layers:
        with pytest.raises(ValueError):
            parallel.pipeline_stage_layers(layers, stages)
        return
    split = parallel.pipeline_stage_layers(layers, stages)
    assert sum(split) == layers and max(split) - min(split) <= 1 and len(split) == stages


# -- expert parallelism -------------------------------------------------------------------


@given(st.integers(0, 4), st.integers(1, 8), st.sampled_from([8, 16, 32]), st.integers(1, 4))
def test_all_to_all_bytes_match_tokens_routed_one_by_one(log_ep, top_k, num_experts, rounds):
    ep = 2**log_ep
    if top_k > num_experts or num_experts % ep:
        return
    hidden, elem = 16, 2
    tokens = num_experts * rounds  # token t's j-th expert: (t * top_k + j) % E, every expert alike
    per_rank = num_experts // ep
    home = 0
    remote = sum(
        1
        for t in range(tokens)
        for j in range(top_k)
        if ((t * top_k + j) % num_experts) // per_rank != home
    )
    got = parallel.moe_all_to_all_bytes(tokens, hidden, top_k, ep, "bfloat16")
    assert got.dispatch == pytest.approx(remote * hidden * elem)
    assert got.combine == got.dispatch and got.total == 2 * got.dispatch


def test_experts_per_rank_and_the_catalog():
    ds = parallel.MOE_MODELS["DeepSeek V3"]
    assert parallel.experts_per_rank(ds.num_experts, 32) == 8
    with pytest.raises(ValueError, match="must divide"):
        parallel.experts_per_rank(ds.num_experts, 3)
    assert parallel.MOE_MODELS["Qwen3-30B-A3B"].top_k == 8


@given(st.lists(st.integers(0, 50), min_size=4, max_size=16), st.integers(0, 3), st.integers(0, 8))
def test_replication_keeps_every_token_and_every_expert(loads, log_ep, redundant):
    ep = 2**log_ep
    loads = loads[: len(loads) - len(loads) % ep] or loads[:ep]
    if len(loads) < ep or sum(loads) == 0 or (len(loads) + redundant) % ep:
        return
    try:
        placed = parallel.replicate_experts(loads, ep, redundant)
    except ValueError as error:  # one expert would need a replica on every rank and more
        assert "more replicas" in str(error)
        return
    slots = [e for rank in placed.slots for e in rank]
    assert sorted(set(slots)) == list(range(len(loads)))
    assert len(slots) == len(loads) + redundant
    assert {len(rank) for rank in placed.slots} == {(len(loads) + redundant) // ep}
    assert all(len(set(rank)) == len(rank) for rank in placed.slots)
    assert sum(placed.loads) == pytest.approx(sum(loads))
    assert all(placed.replicas[e] == slots.count(e) for e in range(len(loads)))


def test_replication_evens_out_a_hot_expert():
    loads = [10, 1, 1, 1, 5, 1, 1, 4]  # expert 0 is hot
    before = parallel.load_imbalance(parallel.rank_loads(loads, 4))
    assert before == pytest.approx(11 / 6)  # rank 0 holds experts 0 and 1: 11 of 24
    after = parallel.replicate_experts(loads, 4, 4)
    assert after.replicas[0] == 3
    assert after.imbalance < 1.2 < before
    with pytest.raises(ValueError, match="multiple of ep"):
        parallel.replicate_experts(loads, 4, 3)


# -- memory and KV transfer ---------------------------------------------------------------


def test_kv_transfer_bytes_are_the_kv_tensors_transformers_keeps():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    prompt_len = 11
    with torch.no_grad():
        cache = hf(torch.arange(prompt_len)[None], use_cache=True).past_key_values
    kv = sum(
        layer.keys.numel() * layer.keys.element_size()
        + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )
    from minillm.model.config import ModelConfig

    config = ModelConfig.from_hf_config(
        {**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    assert parallel.kv_transfer_bytes(config, prompt_len, "float32") == kv


def test_kv_transfer_time_recomputes_the_seeds_figure():
    # an 8K Llama 3.1 8B prefix over PCIe Gen5 at an assumed 50 GB/s: 21 ms
    link = interconnect.Link("50 GB/s", 50e9, 0.0, "", "")
    t = parallel.kv_transfer_time_s(get_model_config("Llama 3.1 8B"), 8192, link)
    assert t == pytest.approx(8192 * 128 * 1024 / 50e9) and round(t * 1e3) == 21
    assert parallel.kv_transfer_time_s(
        get_model_config("Llama 3.1 8B"), 8192, link, num_links=4
    ) == pytest.approx(t / 4)


def test_memory_per_gpu_splits_weights_and_kv():
    c = get_model_config("Llama 3.3 70B")
    weights = roofline.model_weight_bytes(c)
    assert parallel.weight_bytes_per_gpu(c, 4, 2) == pytest.approx(weights / 8)
    # 8 KV heads over 4 ranks: 2 each; 80 layers over 2 stages: 40 each
    assert parallel.kv_bytes_per_gpu(c, 1000, 4, 2) == 1000 * 2 * 40 * 2 * 128 * 2
    # 16 ranks > 8 KV heads: each rank still caches one head
    assert parallel.kv_bytes_per_gpu(c, 1000, 16, 1) == 1000 * 2 * 80 * 1 * 128 * 2
    h100 = get_device("H100 SXM")
    assert parallel.min_gpus_for_weights(c, h100) == math.ceil(weights / (80e9 * 0.9)) == 2


# -- choosing a layout --------------------------------------------------------------------


def test_layouts_are_every_allowed_factorization():
    c = get_model_config("Llama 3.1 8B")  # 32 heads, 8 KV heads, 32 layers
    got = set(parallel.layouts(c, 8))
    brute = {
        (tp, pp, dp)
        for tp, pp, dp in itertools.product(range(1, 9), repeat=3)
        if tp * pp * dp == 8
        and 32 % tp == 0
        and c.intermediate_size % tp == 0
        and (8 % tp == 0 or tp % 8 == 0)
    }
    assert got == brute


def test_estimate_is_the_roofline_split_plus_the_links():
    c, h100 = get_model_config("Llama 3.3 70B"), get_device("H100 SXM")
    link = interconnect.get_link("NVLink 4 (H100/H200 SXM)")
    e = parallel.estimate_layout(c, h100, link, 4, 2, 1, 64, 4096)
    cost = roofline.decode_step_cost(c, 64, 4096)
    floor = max(
        cost.flops / h100.peak_flops("bfloat16"), cost.min_bytes / h100.memory_bandwidth_bytes_per_s
    )
    assert e.compute_s == pytest.approx(floor / 4)
    ar = 2 * 3 * link.latency_s + 2 * 3 / 4 * (64 * 8192 * 2) / link.bandwidth_bytes_per_s
    hand_off = link.latency_s + 64 * 8192 * 2 / link.bandwidth_bytes_per_s
    assert e.communication_s == pytest.approx(161 * ar + hand_off)
    assert e.tokens_per_s == pytest.approx(64 / e.step_s)


@given(st.sampled_from(model_names()), st.sampled_from([1, 2, 4, 8]), st.integers(1, 256))
def test_free_links_make_more_tensor_parallelism_never_slower(name, num_gpus, batch):
    c, h100 = get_model_config(name), get_device("H100 SXM")
    by_tp = {}
    for tp, pp, dp in parallel.layouts(c, num_gpus):
        if pp == 1 and dp == 1:
            by_tp[tp] = parallel.estimate_layout(c, h100, FAST, tp, 1, 1, batch, 2048).step_s
    times = [by_tp[tp] for tp in sorted(by_tp)]
    assert times == sorted(times, reverse=True)


def test_choose_layout_prefers_tensor_parallelism_on_nvlink_but_not_on_pcie():
    c, h100 = get_model_config("Llama 3.3 70B"), get_device("H100 SXM")
    nvlink = interconnect.get_link("NVLink 4 (H100/H200 SXM)")
    pcie = interconnect.get_link("PCIe Gen5 x16")
    best_nv = parallel.choose_layout(c, h100, nvlink, 8, 64, 4096, 0.030)[0]
    best_pcie = parallel.choose_layout(c, h100, pcie, 8, 64, 4096, 0.030)[0]
    assert (best_nv.tp, best_nv.pp, best_nv.dp) == (8, 1, 1)
    assert best_pcie.tp < 8
    # brute force over the same estimates
    every = [parallel.estimate_layout(c, h100, pcie, *t, 64, 4096) for t in parallel.layouts(c, 8)]
    ok = [e for e in every if e.fits and e.step_s <= 0.030]
    assert best_pcie.tokens_per_s == max(e.tokens_per_s for e in ok)
    assert parallel.choose_layout(c, h100, pcie, 8, 64, 4096, 1e-4) == []
    with pytest.raises(ValueError, match="itl_target_s"):
        parallel.choose_layout(c, h100, pcie, 8, 64, 4096, 0)


# -- measurement --------------------------------------------------------------------------


def test_alpha_beta_fit_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    alpha, beta = collective_bench.fit_alpha_beta(sizes, [2e-4 + 3e-9 * n for n in sizes])
    assert alpha == pytest.approx(2e-4) and beta == pytest.approx(3e-9)
    with pytest.raises(ValueError):
        collective_bench.fit_alpha_beta([1, 1], [1, 2])


def test_all_reduce_runs_over_two_processes():
    timing = collective_bench.measure_all_reduce([4096, 65536], world_size=2, repeats=2)
    assert timing.backend in ("gloo", "nccl") and timing.sizes_bytes == [4096, 65536]
    assert all(
        lo <= med <= hi
        for lo, med, hi in zip(timing.min_s, timing.median_s, timing.max_s, strict=True)
    )
    assert all(t > 0 for t in timing.min_s)
    with pytest.raises(ValueError, match="multiples of 4"):
        collective_bench.measure_all_reduce([3])


def _visible_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_ranks_fall_back_to_cpu_processes_on_one_gpu(monkeypatch):
    from minillm.distributed.parallel_state import ranks_device
    from minillm.engine.args import EngineArgs

    _visible_gpus(monkeypatch, 1)  # Colab's GPU runtime
    device, why = ranks_device(2)
    assert device == "cpu" and "gloo" in why and "1 GPU is visible" in why
    # what the chapter's disaggregation run builds on that machine is accepted
    EngineArgs(device=device, kv_transfer_config={"kv_connector": "TorchDistributedConnector"})
    _visible_gpus(monkeypatch, 2)
    assert ranks_device(2) == ("cuda", "2 GPUs over NCCL")
    assert ranks_device(4)[0] == "cpu"
    _visible_gpus(monkeypatch, 0)
    assert ranks_device(2) == ("cpu", "2 CPU processes over gloo (no GPU visible)")


def test_all_reduce_measures_cpu_processes_with_one_gpu(monkeypatch):
    _visible_gpus(monkeypatch, 1)
    timing = collective_bench.measure_all_reduce([4096], world_size=2, repeats=1)
    assert timing.backend == "gloo" and "1 GPU is visible" in timing.where


def test_remote_ranks_per_token_matches_enumeration():
    # every top-2 choice of 8 experts on 4 ranks (2 each), counted by hand
    from itertools import combinations

    choices = list(combinations(range(8), 2))
    remote = [len({e // 2 for e in c} - {0}) for c in choices]
    assert parallel.remote_ranks_per_token(8, 2, 4) == pytest.approx(sum(remote) / len(choices))
    # DeepSeek V3 at EP=8: 256 experts, top 8; no chosen expert on a rank with p 0.338
    assert parallel.remote_ranks_per_token(256, 8, 8) == pytest.approx(7 * (1 - 0.338), abs=5e-3)


def test_per_rank_dispatch_is_smaller_than_per_expert():
    naive = parallel.moe_all_to_all_bytes(256, 7168, 8, 8)
    per_rank = parallel.moe_all_to_all_bytes_per_rank(256, 7168, 256, 8, 8)
    ranks = parallel.remote_ranks_per_token(256, 8, 8)
    assert per_rank.dispatch == pytest.approx(256 * ranks * (7168 + 56 * 4))
    assert per_rank.combine == pytest.approx(256 * ranks * 7168 * 2)
    assert per_rank.dispatch < naive.dispatch / 2


def test_relative_fit_lets_small_messages_set_alpha():
    sizes = [4096.0, 65536.0, 1048576.0, 16777216.0]
    exact = [1e-3 + 1e-9 * n for n in sizes]
    alpha, beta = collective_bench.fit_alpha_beta_relative(sizes, exact)
    assert alpha == pytest.approx(1e-3) and beta == pytest.approx(1e-9)
    wobbly = [*exact[:-1], exact[-1] * 1.1]  # the 16 MiB point 10 % slow
    slope, intercept = __import__("numpy").polyfit(sizes, wobbly, 1, w=[1 / t for t in wobbly])
    alpha, beta = collective_bench.fit_alpha_beta_relative(sizes, wobbly)
    assert alpha == pytest.approx(intercept) and beta == pytest.approx(slope)
    plain = collective_bench.fit_alpha_beta(sizes, wobbly)[0]
    assert abs(alpha - 1e-3) < abs(plain - 1e-3) / 2


def test_pipelined_layout_prices_micro_batches_in_flight():
    from minillm.lab import ch08_setup

    ch = ch08_setup.start_page()
    cfg, dev, link = ch.llama70b, ch.h100, ch.pcie5
    drained = parallel.estimate_layout(cfg, dev, link, 4, 2, 1, 64, 4096)
    steady = parallel.estimate_layout(cfg, dev, link, 4, 2, 1, 64, 4096, pipelined=True)
    # by hand: two micro-batches of 32; a stage holds half the layers on 4 GPUs
    cost = roofline.decode_step_cost(cfg, 32, 4096, "bfloat16")
    stage = roofline.step_time_floor_s(
        cost, dev.peak_flops("bfloat16"), dev.memory_bandwidth_bytes_per_s
    ) / (4 * 2)
    stage += parallel.tp_communication_time_s(cfg, 32, 4, link) / 2
    stage += interconnect.transfer_time_s(32 * cfg.hidden_size * 2, link)
    assert steady.step_s == pytest.approx(2 * stage)
    assert steady.step_s < drained.step_s and steady.tokens_per_s > drained.tokens_per_s
    assert steady.memory_per_gpu_bytes == drained.memory_per_gpu_bytes
    one_stage = parallel.estimate_layout(cfg, dev, link, 8, 1, 1, 64, 4096, pipelined=True)
    assert one_stage == parallel.estimate_layout(cfg, dev, link, 8, 1, 1, 64, 4096)
