"""Pipeline parallelism: the split of layers and batches (properties), the bubble formula,
and a two-stage engine against one process."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import GREEDY, PROMPTS
from hypothesis import given
from hypothesis import strategies as st

from minillm import LLM
from minillm.distributed.pipeline import (
    StageTiming,
    bubble_fraction,
    measured_bubble,
    split_micro_batches,
    stage_layers,
)


@given(st.integers(1, 64), st.integers(1, 8))
def test_stages_hold_consecutive_layers_in_equal_shares(num_layers, num_stages):
    ranges = [stage_layers(num_layers, s, num_stages) for s in range(num_stages)]
    assert [layer for start, end in ranges for layer in range(start, end)] == list(
        range(num_layers)
    )
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@dataclass
class Chunk:
    num_new_tokens: int


@given(st.lists(st.integers(1, 300), min_size=1, max_size=20), st.integers(1, 8))
def test_micro_batches_are_runs_of_whole_requests_in_order(tokens, num_micro_batches):
    chunks = [Chunk(n) for n in tokens]
    batches = split_micro_batches(chunks, num_micro_batches)
    assert [chunk for batch in batches for chunk in batch] == chunks
    assert len(batches) == min(num_micro_batches, len(chunks))
    assert all(batches)


@pytest.mark.parametrize(
    ("stages", "micro_batches", "expected"),
    [(1, 4, 0.0), (2, 1, 1 / 2), (2, 2, 1 / 3), (4, 4, 3 / 7)],
)
def test_bubble_formula(stages, micro_batches, expected):
    assert bubble_fraction(stages, micro_batches) == pytest.approx(expected)


def test_measured_bubble_of_a_gpipe_schedule():
    # two stages, two micro-batches of 1 s each: stage 0 works in [0, 2], stage 1 in [1, 3]
    timings = [StageTiming(2, 2.0, 0.0, 2.0), StageTiming(2, 2.0, 1.0, 3.0)]
    assert measured_bubble(timings) == pytest.approx(1 / 3)


@pytest.fixture(scope="module")
def pp_engine():
    llm = LLM(
        dtype="float32",
        pipeline_parallel_size=2,
        pipeline_micro_batches=2,
        max_num_batched_tokens=32,
    )
    yield llm
    llm.shutdown()


def test_greedy_output_matches_one_process(pp_engine, reference_outputs):
    outputs = pp_engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs


def test_stages_record_micro_batches_and_the_hidden_states_they_pass(pp_engine):
    pp_engine.engine.clear_parallel_stats()
    pp_engine.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    first, last = pp_engine.engine.pipeline_stats()
    hidden_size = pp_engine.engine.config.hidden_size
    assert len(first) == len(last) > 0
    for sent, received in zip(first, last, strict=True):
        assert sent.step == received.step and sent.num_tokens == received.num_tokens
        m = sent.timing.num_micro_batches
        assert m == received.timing.num_micro_batches and 1 <= m <= 2
        # stage 0 sends every micro-batch's hidden states, float32, to stage 1
        assert sent.collectives.calls["send"] == m
        assert sent.collectives.bytes["send"] == sent.num_tokens * hidden_size * 4
        assert "send" not in received.collectives.calls
        bubble = measured_bubble([sent.timing, received.timing])
        assert 0.0 <= bubble < 1.0
    # a step with several requests keeps both stages busy with two micro-batches
    assert any(record.timing.num_micro_batches == 2 for record in first)
