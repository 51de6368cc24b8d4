"""/metrics, parsed with prometheus_client's own parser, against the engine's counts and
what the clients received."""

from __future__ import annotations

import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minillm.serve import run_server

# vLLM v0.11's buckets (vllm/v1/metrics/loggers.py), typed from its source
VLLM_ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
VLLM_TTFT_BUCKETS += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0]
VLLM_ITL_BUCKETS += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]

SHARED = "import collections\nimport itertools\nimport functools\n\n\nclass Cache:\n"


def scrape(url: str) -> dict[str, float]:
    """Every sample as {name{sorted labels}: value}, e.g. 'vllm:prompt_tokens_total'."""
    samples = {}
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}")
            samples[key if labels else s.name] = s.value
    return samples


@pytest.fixture(scope="module")
def run(llm):
    """A fresh server (its own registry), a few requests with known token counts."""
    with run_server(llm, port=0) as server:
        before = llm.engine.kv_cache_manager.prefix_cache_stats.num_hit_tokens
        queried_before = llm.engine.kv_cache_manager.prefix_cache_stats.num_queried_tokens
        usages = []
        bodies = [
            {"prompt": SHARED + "    pass", "max_tokens": 5, "ignore_eos": True},
            {"prompt": SHARED + "    x = 1", "max_tokens": 7, "ignore_eos": True},
            {"prompt": "def f(a, b):", "max_tokens": 3, "ignore_eos": True, "n": 2, "seed": 1},
            {"prompt": ["x = 1", "y = 2"], "max_tokens": 4, "ignore_eos": True},
        ]
        for body in bodies:
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200
            usages.append(response.json()["usage"])
        stats = llm.engine.kv_cache_manager.prefix_cache_stats
        engine_hits = stats.num_hit_tokens - before
        engine_queries = stats.num_queried_tokens - queried_before
        yield scrape(server.url), usages, (engine_hits, engine_queries, before, queried_before)


def test_token_counters_equal_the_usage_the_clients_got(run):
    samples, usages, _ = run
    assert samples["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert samples["vllm:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)


def test_one_latency_per_request_and_one_gap_per_token_after_the_first(run):
    samples, _, _ = run
    num_requests = 5  # the batch of two prompts is two requests; n=2 is one request
    names = ("time_to_first_token", "e2e_request_latency", "request_queue_time")
    for name in (*names, "request_time_per_output_token"):  # every request had 2+ tokens
        assert samples[f"vllm:{name}_seconds_count"] == num_requests
    # gaps: 5-1 + 7-1 + (3-1, the n=2 completions advance together) + 2 * (4-1)
    assert samples["vllm:inter_token_latency_seconds_count"] == 4 + 6 + 2 + 6
    assert samples["vllm:request_success_total{finished_reason=length}"] == num_requests
    assert samples["vllm:request_generation_tokens_sum"] == 5 + 7 + 6 + 8
    assert 0 < samples["vllm:time_to_first_token_seconds_sum"]
    assert (
        samples["vllm:time_to_first_token_seconds_sum"]
        <= (samples["vllm:e2e_request_latency_seconds_sum"])
    )


def test_the_prefix_cache_counters_are_the_engines(run):
    samples, _, (hits, queries, hits_before, queries_before) = run
    # the counters report the engine's totals since it started (this engine served before)
    assert samples["vllm:prefix_cache_hits_total"] == hits_before + hits
    assert samples["vllm:prefix_cache_queries_total"] == queries_before + queries
    assert hits >= 16  # the second prompt found the first's full block(s)


def test_the_gauges_read_an_idle_engine(run):
    samples, _, _ = run
    assert samples["vllm:num_requests_running"] == 0
    assert samples["vllm:num_requests_waiting"] == 0
    assert samples["vllm:kv_cache_usage_perc"] == 0


def test_the_buckets_are_vllms(run):
    samples, _, _ = run

    def bounds(name: str) -> list[float]:
        prefix = f"vllm:{name}_bucket{{le="
        found = [float(k[len(prefix) : -1]) for k in samples if k.startswith(prefix)]
        return sorted(found)

    assert bounds("time_to_first_token_seconds") == [*VLLM_TTFT_BUCKETS, math.inf]
    assert bounds("inter_token_latency_seconds") == [*VLLM_ITL_BUCKETS, math.inf]


def test_the_phase_histograms_split_each_request_as_vllms_dashboard_reads_them(run):
    samples, _, _ = run
    num_requests = 5
    phases = ("prefill_time", "decode_time", "inference_time")
    for phase in phases:
        assert samples[f"vllm:request_{phase}_seconds_count"] == num_requests
    prefill, decode, inference = (samples[f"vllm:request_{p}_seconds_sum"] for p in phases)
    assert prefill > 0 and decode > 0
    assert prefill + decode == pytest.approx(inference)  # first token: where one ends
    assert inference <= samples["vllm:e2e_request_latency_seconds_sum"]
    # the longest completion of each request: 5, 7, 3 (n=2, both 3), 4 and 4
    assert samples["vllm:request_max_num_generation_tokens_sum"] == 5 + 7 + 3 + 4 + 4
    assert samples["vllm:request_params_n_sum"] == 1 + 1 + 2 + 1 + 1


def test_max_tokens_and_tokens_per_step_are_counted_as_vllm_counts_them(run):
    """request_params_max_tokens: each finished request's max_tokens; iteration_tokens_total:
    per step, the prompts of the requests it gave a first token plus the tokens it sampled,
    so that over the run it sums to every prompt token plus every output token."""
    samples, usages, _ = run
    assert samples["vllm:request_params_max_tokens_count"] == 5
    assert samples["vllm:request_params_max_tokens_sum"] == 5 + 7 + 3 + 4 + 4
    total = sum(u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert samples["vllm:iteration_tokens_total_sum"] == total
    steps = samples["vllm:iteration_tokens_total_count"]
    assert 7 <= steps < total  # the longest request ran 7 steps; steps batch several tokens
    prefix = "vllm:iteration_tokens_total_bucket{le="
    bounds = sorted(float(k[len(prefix) : -1]) for k in samples if k.startswith(prefix))
    assert bounds == [*VLLM_ITERATION_TOKENS_BUCKETS, math.inf]


def test_every_series_has_vllms_labels_and_cache_config_info_the_pools_size(reference_llm):
    llm = reference_llm  # the module's server holds `llm`
    with run_server(llm, port=0, served_model_name="m") as server:
        text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in families.values():
        if family.name.startswith("vllm:") and family.name != "vllm:cache_config_info":
            for sample in family.samples:
                assert sample.labels["model_name"] == "m" and sample.labels["engine"] == "0"
    [info] = families["vllm:cache_config_info"].samples
    assert info.value == 1
    args = llm.engine.engine_args
    assert info.labels == {
        "block_size": str(args.block_size),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "enable_prefix_caching": str(args.enable_prefix_caching),
        "gpu_memory_utilization": str(args.gpu_memory_utilization),
        "kv_cache_memory_bytes": "None",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(llm.engine.kv_cache_manager.block_pool.num_blocks),
        "num_gpu_blocks_override": "None",
        "engine": "0",
    }
