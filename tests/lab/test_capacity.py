"""The capacity planner against cases computed by hand (the arithmetic is written out here,
from the model's published sizes and the datasheet, without minillm's counting code)."""

from __future__ import annotations

import math

import pytest

from minillm.lab.capacity import (
    Slo,
    best_operating_point,
    cost_per_million_tokens,
    operating_point,
    plan_capacity,
    replicas_needed,
    roofline_step_times,
)
from minillm.lab.catalog import get_model_config
from minillm.lab.hardware import get_device


def linear_step(b: int) -> float:
    """A made-up engine: 10 ms a decode step plus 1 ms per sequence in the batch."""
    return 0.010 + 0.001 * b


def test_one_operating_point_by_hand():
    # b = 10: t_d = 0.010 + 0.010 = 0.020 s; prefill 0.05 s; 100 in, 50 out
    # 10 requests take 50 * 0.020 + 10 * 0.05 = 1.0 + 0.5 = 1.5 s  ->  10 / 1.5 req/s
    # TPOT = 0.020 + 10 * 0.05 / 50 = 0.030 s; TTFT = 0.05 + 0.020 = 0.070 s
    point = operating_point(linear_step, 0.05, 10, 100, 50)
    assert point.requests_per_s == pytest.approx(10 / 1.5)
    assert point.tpot_s == pytest.approx(0.030)
    assert point.ttft_s == pytest.approx(0.070)
    assert point.output_tokens_per_s == pytest.approx(10 / 1.5 * 50)  # 333.3
    assert point.total_tokens_per_s == pytest.approx(1000.0)  # 6.667 * 150


def test_the_slo_picks_the_batch_and_the_load_the_replicas():
    # TPOT(b) = 0.010 + 0.001 b + b * 0.05 / 50 = 0.010 + 0.002 b <= 0.030  ->  b <= 10;
    # X(b) = b / (0.5 + 0.1 b) grows with b, so b = 10 and X = 6.667 req/s
    slo = Slo(tpot_s=0.030 + 1e-12, ttft_s=0.1)
    best = best_operating_point(linear_step, 0.05, 64, 100, 50, slo)
    assert best.batch_size == 10
    # a TTFT target below 0.05 + 0.011 s cannot be met at any batch size
    assert best_operating_point(linear_step, 0.05, 64, 100, 50, Slo(0.03, 0.0605)) is None
    # 15 req/s: 15 / 6.667 = 2.25 -> 3 replicas; at 80% each: 15 / 5.333 = 2.81 -> 3;
    # 18 req/s at 80%: 18 / 5.333 = 3.375 -> 4
    assert replicas_needed(15, best.requests_per_s) == 3
    assert replicas_needed(15, best.requests_per_s, 0.8) == 3
    assert replicas_needed(18, best.requests_per_s, 0.8) == 4
    # $2 an hour at 1000 tokens/s: 10**6 tokens take 1000 s = 1000 * 2 / 3600 = $0.5556
    assert cost_per_million_tokens(2.0, best.total_tokens_per_s) == pytest.approx(1000 * 2 / 3600)
    # the output tokens alone: 333.3 /s -> 3000 s -> $1.667
    assert cost_per_million_tokens(2.0, best.output_tokens_per_s) == pytest.approx(3000 * 2 / 3600)


# Llama 3.1 8B: 8,030,261,248 parameters (its model card); an untied 128256 x 4096 embedding
# table, which a decode step does not read in full; 32 layers, 8 KV heads of 128:
# K and V of one token = 2 * 32 * 8 * 128 values * 2 bytes = 131,072 bytes in bfloat16.
LLAMA_8B_PARAMS = 8_030_261_248
EMBEDDING = 128_256 * 4_096
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2
H100_BANDWIDTH = 3.35e12  # bytes/s, the H100 SXM datasheet
H100_BF16 = 989.4e12  # dense FLOP/s


def test_llama_8b_on_an_h100_by_hand():
    config, device = get_model_config("Llama 3.1 8B"), get_device("H100 SXM")
    decode, prefill = roofline_step_times(config, device, input_len=1000, output_len=200)
    # decode at batch 1 is bandwidth-bound: every weight but the embedding table, plus the
    # KV of the mean context 1000 + 200 // 2 = 1100 tokens
    bytes_1 = (LLAMA_8B_PARAMS - EMBEDDING) * 2 + 1100 * KV_PER_TOKEN
    assert decode(1) == pytest.approx(bytes_1 / H100_BANDWIDTH, rel=1e-9)  # 4.52 ms
    # the prefill of 1000 tokens is compute-bound: per layer the GEMMs hold
    # 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 = 218,103,808 weights,
    # 2 FLOPs each per token; attention 4 * 4096 FLOPs per causal pair, 1000 * 1001 / 2
    # pairs; the LM head for the last token only
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    flops = 32 * (2 * 1000 * per_layer + 4 * 4096 * 1000 * 1001 // 2) + 2 * 4096 * 128_256
    assert prefill == pytest.approx(flops / H100_BF16, rel=1e-9)  # 14.4 ms


def test_a_whole_plan_by_hand():
    slo = Slo(tpot_s=0.050, ttft_s=0.5)
    plan = plan_capacity(
        "Llama 3.1 8B",
        "H100 SXM",
        target_requests_per_s=20.0,
        input_len=1000,
        output_len=200,
        slo=slo,
        price_per_gpu_hour=2.5,
    )
    # the KV pool: 90% of the 79.18 GiB CUDA reports, less all the weights in bfloat16;
    # sequences of 1200 tokens; vLLM gives a >= 70 GiB H100 max_num_seqs = 1024
    pool = 79.18 * 2**30 * 0.9 - LLAMA_8B_PARAMS * 2
    assert plan.max_batch_size == min(1024, int(pool // (1200 * KV_PER_TOKEN)))  # 384
    point = plan.point
    assert point.tpot_s <= slo.tpot_s and point.ttft_s <= slo.ttft_s
    # the next batch size breaks the TPOT target (or the KV pool's limit is reached)
    config, device = get_model_config("Llama 3.1 8B"), get_device("H100 SXM")
    decode, prefill = roofline_step_times(config, device, 1000, 200)
    b = point.batch_size
    assert b == plan.max_batch_size or decode(b + 1) + (b + 1) * prefill / 200 > slo.tpot_s
    # replicas and cost from the point's own rate, by the formulas
    x = b / (200 * decode(b) + b * prefill)
    assert point.requests_per_s == pytest.approx(x)
    assert plan.replicas == math.ceil(20.0 / x)
    assert plan.cost_per_million_tokens_full_load == pytest.approx(1e6 * 2.5 / 3600 / (x * 1200))
    assert plan.cost_per_million_tokens_at_target == pytest.approx(
        plan.replicas * 2.5 / 3600 / (20.0 * 1200) * 1e6
    )


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="efficiency"):
        roofline_step_times(get_model_config("Qwen3-0.6B"), get_device("L4"), 10, 10, efficiency=0)
    with pytest.raises(ValueError, match="target_utilization"):
        replicas_needed(1, 1, 1.5)
    with pytest.raises(ValueError, match="SLO"):
        plan_capacity(
            "Llama 3.1 8B",
            "H100 SXM",
            target_requests_per_s=1,
            input_len=1000,
            output_len=200,
            slo=Slo(tpot_s=1e-4, ttft_s=1.0),
            price_per_gpu_hour=2.0,
        )


def test_the_plan_counts_the_wait_for_a_seat():
    # the plan at mean rates runs each replica near its limit; by Erlang C (the textbook
    # sum in exact arithmetic, not the module's recursion) its p99 wait for a seat is far
    # past the TTFT target, and a plan for the p99 TTFT adds replicas until it is not
    from fractions import Fraction

    def p99_wait(seats: int, rate: float, hold: float) -> float:
        a = Fraction(rate * hold)
        top = a**seats / math.factorial(seats) * seats / (seats - a)
        p_wait = float(top / (sum(a**k / math.factorial(k) for k in range(seats)) + top))
        return max(0.0, hold * math.log(p_wait / 0.01) / (seats - float(a)))

    kwargs = dict(
        target_requests_per_s=50.0,
        input_len=1000,
        output_len=200,
        price_per_gpu_hour=2.5,
        efficiency=0.7,
    )
    mean_plan = plan_capacity("Llama 3.1 8B", "H100 SXM", slo=Slo(0.05, 0.5), **kwargs)
    p99_plan = plan_capacity("Llama 3.1 8B", "H100 SXM", slo=Slo(0.05, 0.5, 0.99), **kwargs)
    point = mean_plan.point
    hold = point.batch_size / point.requests_per_s  # a seat is held one cycle
    assert mean_plan.utilization == pytest.approx(50 / (mean_plan.replicas * point.requests_per_s))
    wait = p99_wait(point.batch_size, 50 / mean_plan.replicas, hold)
    assert mean_plan.seat_wait_p99_s == pytest.approx(wait, rel=1e-6)
    assert point.ttft_s + wait > 0.5  # the mean plan misses the p99 TTFT target
    assert p99_plan.point == point
    r = p99_plan.replicas
    assert r > mean_plan.replicas
    assert point.ttft_s + p99_wait(point.batch_size, 50 / r, hold) <= 0.5
    assert point.ttft_s + p99_wait(point.batch_size, 50 / (r - 1), hold) > 0.5
    with pytest.raises(ValueError, match="ttft_percentile"):
        Slo(0.05, 0.5, 99)
