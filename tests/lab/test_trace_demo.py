"""Chapter 5's eager-against-traced comparison: both engines' tokens compared, rounds kept."""

from __future__ import annotations

import pathlib
import sys

import pytest

from minillm.lab.trace_demo import TraceComparison, compare_decode_steps
from minillm.worker.decode_trace import DecodeTrace

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "engine"))
from tiny_llama import build_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_both_engines_decode_the_same_tokens_in_interleaved_rounds(model_dir):
    run = compare_decode_steps(model_dir, num_seqs=3, rounds=2, steps=3, prompt_len=5)
    assert run.identical
    assert len(run.eager_ms) == len(run.traced_ms) == 2
    assert all(t > 0 for t in run.eager_ms + run.traced_ms)
    assert run.num_replays >= 2 * 3  # every timed step of the traced engine replayed


def test_a_trace_that_computes_something_else_is_caught(model_dir, monkeypatch):
    replay = DecodeTrace.run

    def wrong(self, ids, positions, meta):
        return replay(self, ids, positions, meta) + 1.0

    monkeypatch.setattr(DecodeTrace, "run", wrong)
    run = compare_decode_steps(model_dir, num_seqs=3, rounds=1, steps=3, prompt_len=5)
    assert not run.identical


def test_ratios_and_savings_are_per_round():
    run = TraceComparison(
        num_seqs=4,
        eager_ms=[10.0, 12.0, 9.0],
        traced_ms=[8.0, 8.0, 9.0],
        identical=True,
        num_replays=9,
    )
    assert run.speedups == pytest.approx([1.25, 1.5, 1.0])
    assert run.saved_ms == pytest.approx(2.0)  # the median of 2, 4 and 0


def test_the_ab_command_records_both_engines_rounds(tmp_path):
    import json

    from minillm.lab.trace_demo import main

    model = build_tiny_llama(tmp_path / "model", max_position_embeddings=512)
    out = tmp_path / "ab.json"
    main(["--model", str(model), "--rounds", "2", "--json", str(out)])
    record = json.loads(out.read_text())
    shares = record["overhead_share_64_seqs"]
    assert len(shares["eager"]) == len(shares["traced"]) == 2
    assert all(0.0 <= v < 1.0 for v in shares["eager"] + shares["traced"])
    for n in ("16", "64"):
        steps = record["decode_steps"][n]
        assert steps["identical"] and len(steps["eager_ms"]) == len(steps["speedups"]) == 2
