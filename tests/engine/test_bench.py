"""The offline benchmark's workload and bookkeeping (speed itself is never asserted)."""

import json
import pathlib

from tiny_llama import build_tiny_llama

from minillm.cli.main import main
from minillm.lab.bench import make_workload


def test_workload_is_reproducible_and_within_the_ranges():
    a = make_workload(20, (4, 9), (2, 5), vocab_size=50, special_ids={0, 1}, seed=3)
    b = make_workload(20, (4, 9), (2, 5), vocab_size=50, special_ids={0, 1}, seed=3)
    assert a == b
    assert all(4 <= len(p) <= 9 for p in a.prompts)
    assert all(2 <= n <= 5 for n in a.output_lens)
    assert all(0 < t < 50 and t != 1 for p in a.prompts for t in p)
    assert a.num_output_tokens == sum(a.output_lens)
    assert make_workload(20, (4, 9), (2, 5), 50, {0, 1}, seed=4) != a


def test_bench_offline_runs_all_three_systems_on_the_same_work(tmp_path: pathlib.Path):
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    build_tiny_llama(model_dir)
    out = tmp_path / "bench.json"
    status = main(
        [
            "bench",
            "offline",
            "--model",
            str(model_dir),
            "--num-requests",
            "6",
            "--input-len",
            "4",
            "12",
            "--output-len",
            "2",
            "6",
            "--batch-size",
            "4",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    record = json.loads(out.read_text())
    systems = [r["system"] for r in record["results"]]
    assert systems == [
        "minillm, continuous batching",
        "minillm, one request at a time",
        "transformers generate, static batches of 4",
    ]
    # every system is credited with exactly the requested tokens
    assert {r["num_output_tokens"] for r in record["results"]} == {
        record["workload"]["num_output_tokens"]
    }
    baseline = record["results"][0]["output_tokens_per_s"]
    for r in record["results"][1:]:
        expected = baseline / r["output_tokens_per_s"]
        assert abs(record["speedup_vs"][r["system"]] - expected) < 1e-9
