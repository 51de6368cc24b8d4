"""Launches and FLOPs of the three ways to run a MoE layer's expert GEMMs, checked against a
count row by row and tile by tile; the three compute the same products; real routes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.lab import grouped_gemm


def brute_force(sizes, n, k, block_m):
    """Count multiply-adds by walking every row each strategy computes."""
    per_row = 2 * n * k
    useful = sum(per_row for m in sizes for _ in range(m))
    padded_rows = sum(1 for _ in sizes for _ in range(max(sizes)))
    tiled_rows = 0
    for m in sizes:
        left = m
        while left > 0:  # one tile of block_m rows, however few are real
            tiled_rows += block_m
            left -= block_m
    return useful, per_row * padded_rows, per_row * tiled_rows


def test_worked_example():
    costs = grouped_gemm.strategy_costs([3, 0, 5], n=2, k=4, block_m=4)
    assert (costs["per expert"].launches, costs["per expert"].experts_read) == (2, 2)
    assert costs["per expert"].flops == 2 * 8 * 2 * 4 == costs["per expert"].useful_flops
    assert (costs["padded"].launches, costs["padded"].experts_read) == (1, 3)
    assert costs["padded"].flops == 2 * 15 * 2 * 4
    assert costs["padded"].waste == pytest.approx(1 - 8 / 15)
    assert (costs["grouped"].launches, costs["grouped"].experts_read) == (1, 2)
    assert costs["grouped"].flops == 2 * (4 + 8) * 2 * 4
    assert grouped_gemm.strategy_costs([3, 0, 5], 2, 4)["grouped"].waste == 0.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(any),
    st.integers(1, 9),
    st.integers(1, 9),
    st.integers(1, 32),
)
def test_costs_match_a_row_by_row_count(sizes, n, k, block_m):
    costs = grouped_gemm.strategy_costs(sizes, n, k, block_m)
    useful, padded, tiled = brute_force(sizes, n, k, block_m)
    assert all(c.useful_flops == useful for c in costs.values())
    assert costs["per expert"].flops == useful
    assert costs["padded"].flops == padded
    assert costs["grouped"].flops == tiled
    assert costs["per expert"].launches == len([m for m in sizes if m])
    assert costs["padded"].experts_read == len(sizes)


@pytest.mark.parametrize("sizes", [[], [0, 0], [2, -1]])
def test_bad_group_sizes_are_refused(sizes):
    with pytest.raises(ValueError):
        grouped_gemm.strategy_costs(sizes, 4, 4)


def test_the_strategies_compute_the_same_products():
    sizes = [3, 0, 5, 1]
    fns = grouped_gemm.expert_gemms(sizes, n=8, k=16, seed=1)
    gen = torch.Generator().manual_seed(1)  # the same draws as expert_gemms
    x = torch.randn(sum(sizes), 16, generator=gen)
    w = torch.randn(len(sizes), 16, 8, generator=gen) / 4.0
    owner = [e for e, m in enumerate(sizes) for _ in range(m)]
    want = torch.stack([x[i] @ w[owner[i]] for i in range(len(owner))])
    assert set(fns) >= {"per expert", "padded"}
    assert ("grouped" in fns) == grouped_gemm.grouped_mm_runs()
    for fn in fns.values():
        torch.testing.assert_close(fn(), want, atol=1e-5, rtol=1e-5)


def test_timing_has_every_repeat_of_every_strategy():
    timing = grouped_gemm.time_strategies([4, 1, 0, 6], n=8, k=16, repeats=3)
    assert {"per expert", "padded"} <= set(timing.seconds)
    for name, runs in timing.seconds.items():
        assert len(runs) == 3 and all(t > 0 for t in runs)
        assert min(runs) <= timing.median_s(name) <= max(runs)


def test_router_routes_are_top_k_distinct_experts_and_causal():
    model, tokenizer = grouped_gemm.tiny_router_model(num_experts=16, top_k=4)
    ids = tokenizer.encode("def main(args):\n    return args.value + 1\n", add_special_tokens=False)
    routes = grouped_gemm.router_routes(model, ids)
    assert sorted(routes) == [0, 1]
    for r in routes.values():
        assert r.shape == (len(ids), 4)
        assert int(r.min()) >= 0 and int(r.max()) < 16
        assert all(len(set(row.tolist())) == 4 for row in r)
        sizes = grouped_gemm.group_sizes(r, 16)
        assert len(sizes) == 16 and sum(sizes) == 4 * len(ids)
        assert max(sizes) > sum(sizes) / 16  # random routers do not balance
    prefix = grouped_gemm.router_routes(model, ids[:5])
    for layer in routes:
        assert torch.equal(prefix[layer], routes[layer][:5])
