"""The quantization benchmark's bookkeeping on a tiny run (its speeds are measured, never
asserted)."""

import json

import pytest

from minillm.lab import quant_bench


@pytest.mark.slow
def test_a_small_run_records_every_variant_and_the_goal(tmp_path, capsys):
    path = tmp_path / "q.json"
    assert quant_bench.main(
        ["--repeats", "2", "--num-windows", "1", "--calibration-tokens", "256",
         "--max-tokens", "3", "--json", str(path)]
    ) == 0  # fmt: skip
    rec = json.loads(path.read_text())
    assert list(rec["results"]) == [v.name for v in quant_bench.VARIANTS]
    for key in ("date", "machine", "cpu_count", "threads", "torch", "python"):
        assert rec[key]
    f32, int4 = rec["results"]["float32"], rec["results"]["W4A16 RTN"]
    assert f32["perplexity_increase"] == 0 and f32["bytes_vs_float32"] == 1
    assert 0.25 < int4["bytes_vs_float32"] < 0.35
    assert len(int4["decode_tokens_per_s"]) == 2
    assert len(int4["window_cross_entropy"]) == 1 and int4["format"] == "W4A16"
    assert rec["results"]["W8A8 SmoothQuant"]["format"] == "W8A8"
    assert f32["greedy_vs_float32"] == {"identical": 1, "prompts": 1, "common_prefix": 1.0}
    assert 0 <= int4["greedy_vs_float32"]["common_prefix"] <= 1
    low, high = int4["decode_tokens_per_s_range"]
    assert low <= int4["decode_tokens_per_s_median"] <= high
    goal = rec["goal"]
    assert goal["met"] == (
        goal["gptq_perplexity_increase"] <= 0.5 * goal["rtn_perplexity_increase"]
    )
    assert "goal: W4A16 GPTQ loses at most half" in capsys.readouterr().out


def test_greedy_agreement_counts_identical_outputs_and_common_prefixes():
    got = quant_bench.greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert got == {"identical": 1, "prompts": 2, "common_prefix": (2 / 4 + 1) / 2}


def test_the_goal_prints_without_a_ratio_when_rtn_loses_nothing(capsys):
    goal = {
        "statement": "W4A16 GPTQ loses at most half the perplexity that W4A16 RTN loses",
        "rtn_perplexity_increase": -0.25,
        "gptq_perplexity_increase": 0.125,
        "ratio": None,
        "met": False,
    }
    rec = {"model": "m", "machine": "cpu", "threads": 1, "heldout": {"num_windows": 1},
           "decode": {"repeats": 2}, "results": {}, "goal": goal}  # fmt: skip
    quant_bench.print_table(rec)
    out = capsys.readouterr().out
    assert "NOT met (GPTQ +0.125 vs RTN -0.250, no ratio)" in out
