"""The shared setup of chapter 4's pages: engines, the batching workload, its step counts."""

from __future__ import annotations

import pytest

from minillm.lab.batch_slots import static_batching_idle_slot_steps
from minillm.lab.bench import Workload
from minillm.lab.ch04_setup import (
    EXERCISE_NOTEBOOK,
    batching_step_counts,
    batching_workload,
    exercise_points,
    fixed_length,
    make_engine,
    special_token_ids,
)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def test_fixed_length_asks_for_exactly_that_many_greedy_tokens():
    params = fixed_length(7)
    assert (params.max_tokens, params.temperature, params.ignore_eos) == (7, 0.0, True)


def test_workload_is_twelve_requests_within_the_stated_bounds(engine):
    special = special_token_ids(engine.tokenizer)
    assert special and all(isinstance(t, int) for t in special)
    workload = batching_workload(engine.config.vocab_size, special)
    assert len(workload.prompts) == len(workload.output_lens) == 12
    assert all(16 <= len(p) <= 48 for p in workload.prompts)
    assert all(4 <= n <= 60 for n in workload.output_lens)
    assert not special & {t for p in workload.prompts for t in p}
    assert batching_workload(engine.config.vocab_size, special) == workload


def test_step_counts_of_hand_counted_batches():
    # two seats, outputs 2, 8, 3, 5: static runs batches (2, 8) and (3, 5), 8 + 5 steps;
    # continuous seats the third request at step 2, the fourth at step 5: done after step 9
    workload = Workload([[1] * 4] * 4, [2, 8, 3, 5])
    assert batching_step_counts(workload, 2) == {"static": 13, "continuous": 10}
    # the static count is the idle-slot formula's premise: each batch lasts its longest output
    assert 2 * 13 - sum(workload.output_lens) == static_batching_idle_slot_steps([2, 8, 3, 5], 2)


def test_step_counts_match_the_engine_on_the_pages_workload(engine):
    special = special_token_ids(engine.tokenizer)
    workload = batching_workload(engine.config.vocab_size, special)
    counts = batching_step_counts(workload, 4)
    assert counts["static"] > counts["continuous"]
    for batching_type, expected in counts.items():
        run_engine = make_engine(max_num_seqs=4, batching_type=batching_type)
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            run_engine.add_request(str(i), prompt, fixed_length(n))
        while run_engine.has_unfinished_requests():
            run_engine.step()
        assert run_engine.stats.num_steps == expected, batching_type


def test_exercise_points_of_the_chapter_notebook(tmp_path):
    points = exercise_points()
    assert EXERCISE_NOTEBOOK.exists() and points
    assert all(isinstance(p, int) and p > 0 for p in points)
    assert exercise_points(tmp_path / "missing.ipynb") is None
