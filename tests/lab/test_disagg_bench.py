"""The disaggregation benchmark's arithmetic: worst-gap medians and per-round ratios from
hand-made summaries, and the recorded results file read back whole."""

from __future__ import annotations

import dataclasses
import json

import pytest

from minillm.lab import disagg_bench
from minillm.lab.disagg_bench import LatencySummary


def summary(worst_ms: float) -> LatencySummary:
    return LatencySummary(
        num_requests=4,
        num_itl=12,
        ttft_median_s=0.1,
        ttft_max_s=0.2,
        itl_median_s=0.01,
        itl_max_s=0.5,
        kv_transfer_bytes=0,
        kv_transfer_s=0.0,
        decode_itl_median_s=0.01,
        decode_itl_max_s=worst_ms / 1e3,
        long_prefill_max_s=0.0,
    )


RESULTS = {
    ("disaggregated", "alone"): [summary(40), summary(20), summary(30)],
    ("disaggregated", "with prompts"): [summary(60), summary(50), summary(90)],
}


def test_median_worst_gaps_and_ratios_per_round():
    medians = disagg_bench.median_worst_gaps(RESULTS)
    assert medians["disaggregated", "alone"] == pytest.approx(0.030)
    assert medians["disaggregated", "with prompts"] == pytest.approx(0.060)
    # round by round, not a ratio of medians: 60/40, 50/20, 90/30
    assert disagg_bench.gap_ratios(RESULTS, "disaggregated") == pytest.approx([1.5, 2.5, 3.0])


def test_results_round_trip_through_the_recorded_format(tmp_path):
    path = tmp_path / "disagg.json"
    record = {
        "results": {
            f"{mode}, {prompts}": [dataclasses.asdict(s) for s in summaries]
            for (mode, prompts), summaries in RESULTS.items()
        }
    }
    path.write_text(json.dumps(record))
    _, results = disagg_bench.read_results(path)
    assert results == RESULTS


def test_the_recorded_file_has_every_run_and_equal_rounds():
    record, results = disagg_bench.read_results()
    assert set(results) == set(disagg_bench.RUNS)
    rounds = {len(summaries) for summaries in results.values()}
    assert len(rounds) == 1 and rounds.pop() >= 3
    for (_, prompts), summaries in results.items():
        for s in summaries:
            assert (s.long_prefill_max_s > 0) == (prompts == "with prompts")
    assert record["cpu_count"] >= 1 and "load_average_1m_before" in record
