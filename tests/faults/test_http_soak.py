"""The HTTP soak's short profile: a `minillm serve` process under a few concurrent streaming
clients of every kind for a few seconds, idle checks between, and a SIGTERM drain at the end
(the long run is `python -m tests.faults.soak --http --clients 50 --minutes 20`)."""

from __future__ import annotations

from tests.faults.http_soak import (
    ENGINE_OPTIONS,
    MIX,
    idle_metrics,
    is_idle,
    parse_metrics,
    percentile,
    run_http_soak,
)


def test_a_short_http_soak_loses_no_request_and_leaves_no_block(tmp_path):
    record = run_http_soak(
        minutes=0.15,
        clients=6,
        check_every=25,
        seed=3,
        workdir=tmp_path,
        drain_streams=8,
        transient_every=5,
    )
    assert record["failures"] == 0, record["failure_examples"]
    assert set(record["requests_by_kind"]) == set(MIX)  # every kind ran
    assert record["checks"] >= 2 and record["checks_failed"] == 0
    faults = record["injected_faults"]  # both faults struck, and cost no other request
    assert (
        faults["transient"] >= 1
        and faults["poisoned_steps"] >= record["requests_by_kind"]["faulted"]
    )
    final = record["final_check"]
    assert final["kv_blocks_held"] == 0 and final["kv_blocks"] == ENGINE_OPTIONS["num_gpu_blocks"]
    assert final["running"] == 0 and final["waiting"] == 0 and final["probe_equals_fresh_engine"]
    drain = record["drain"]
    assert drain["lost"] == 0 and drain["exit_status"] == 0
    assert drain["finished"] + drain["ended by the drain"] + drain["refused"] == 8


METRICS = """\
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="96"} 1.0
"""


def test_a_check_sees_blocks_held_by_an_idle_server():
    values = parse_metrics(METRICS)
    assert not is_idle(values)
    summary = idle_metrics(values)
    assert summary["kv_blocks_held"] == 24 and summary["kv_blocks"] == 96
    assert summary["preemptions_so_far"] == 3
    assert is_idle(parse_metrics(METRICS.replace("} 0.25", "} 0.0")))
    assert not is_idle(
        parse_metrics(
            METRICS.replace('"m"} 0.0\nvllm:num_requests_w', '"m"} 1.0\nvllm:num_requests_w')
        )
    )


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
