"""Pipeline parallelism: the split of layers and batches (properties), the bubble formula,
and a two-stage engine against one process."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import GREEDY, PROMPTS
from hypothesis import given
from hypothesis import strategies as st

from minillm import LLM
from minillm.distributed.pipeline import (
    StageTiming,
    bubble_fraction,
    bubble_parts,
    measured_bubble,
    run_bubble,
    split_micro_batches,
    stage_layers,
    uneven_bubble_fraction,
)


@given(st.integers(1, 64), st.integers(1, 8))
def test_stages_hold_consecutive_layers_in_equal_shares(num_layers, num_stages):
    ranges = [stage_layers(num_layers, s, num_stages) for s in range(num_stages)]
    assert [layer for start, end in ranges for layer in range(start, end)] == list(
        range(num_layers)
    )
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(st.lists(st.integers(1, 8), min_size=1, max_size=8), st.data())
def test_a_layer_partition_gives_each_stage_its_count_in_order(partition, data):
    num_layers, num_stages = sum(partition), len(partition)
    ranges = [stage_layers(num_layers, s, num_stages, tuple(partition)) for s in range(num_stages)]
    assert [end - start for start, end in ranges] == partition
    assert [layer for start, end in ranges for layer in range(start, end)] == list(
        range(num_layers)
    )
    stage = data.draw(st.integers(0, num_stages - 1))
    assert stage_layers(num_layers, stage, num_stages, tuple(partition)) == ranges[stage]


def test_layer_partition_by_hand():
    # vLLM's VLLM_PP_LAYER_PARTITION="4,6,6,4" over 20 layers
    assert [stage_layers(20, s, 4, (4, 6, 6, 4)) for s in range(4)] == [
        (0, 4),
        (4, 10),
        (10, 16),
        (16, 20),
    ]
    assert [stage_layers(6, s, 2, (4, 2)) for s in range(2)] == [(0, 4), (4, 6)]


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


def test_busy_holds_a_stages_inputs_and_the_last_stages_sampling(monkeypatch):
    """A stage's busy time is its own work: preparing each micro-batch's inputs, and on the
    last stage sampling the tokens. Slowed here by known waits (forked ranks inherit them),
    both show in it: lower bounds, a sleep never ends early."""
    import time

    from minillm.distributed import pipeline
    from minillm.worker.model_runner import ModelRunner

    prepare, sample = pipeline.prepare_inputs, ModelRunner.sample

    def slow_prepare(*args):
        time.sleep(0.05)
        return prepare(*args)

    def slow_sample(self, *args):
        time.sleep(0.1)
        return sample(self, *args)

    monkeypatch.setattr(pipeline, "prepare_inputs", slow_prepare)
    monkeypatch.setattr(ModelRunner, "sample", slow_sample)
    with LLM(dtype="float32", pipeline_parallel_size=2, pipeline_micro_batches=2) as llm:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        first, last = llm.engine.pipeline_stats()
    assert first and len(first) == len(last)
    for sent, sampled in zip(first, last, strict=True):
        m = sent.timing.num_micro_batches
        assert sent.timing.busy_s >= 0.05 * m
        assert sampled.timing.busy_s >= 0.05 * m + 0.1
        # and the step ends after the sampling: busy within the step's span
        assert sampled.timing.end_s - sampled.timing.start_s >= sampled.timing.busy_s


def test_a_stages_step_runs_from_taking_its_plan_to_handing_back_its_answer(monkeypatch):
    """The host work a rank does on a step outside run_stage counts as the stage's busy time
    (and as its host time), within the step's span. Slowed by a known wait here."""
    import time

    from minillm.distributed.worker import Worker

    execute = Worker.execute_model

    def slow_execute(self, plan):
        time.sleep(0.05)
        return execute(self, plan)

    monkeypatch.setattr(Worker, "execute_model", slow_execute)
    with LLM(dtype="float32", pipeline_parallel_size=2, pipeline_batches_in_flight=2) as llm:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        stages = llm.engine.pipeline_stats()
    for records in stages:
        assert records
        for record in records:
            timing = record.timing
            assert timing.host_s >= 0.05 and timing.busy_s >= timing.host_s
            assert timing.end_s - timing.start_s >= timing.busy_s


def test_widening_a_step_counts_the_host_work_as_busy():
    timing = StageTiming(1, 2.0, 10.0, 13.0)  # 1 s of the 3 s step waiting
    timing.widen(9.5, 13.25)
    assert (timing.start_s, timing.end_s) == (9.5, 13.25)
    assert timing.busy_s == pytest.approx(2.75) and timing.host_s == pytest.approx(0.75)


def test_a_later_stage_receives_hidden_states_while_it_computes():
    """Rank 1 posts a plan's receives when the plan arrives and computes for a second
    before it takes them: rank 0's sends are done long before, and the hidden states arrive
    whole, in order. A receive posted only when the stage turns to the batch would hold
    rank 0's sends for the whole second."""
    from dist_testing import early_receives, run_on_ranks

    sent_s, received = run_on_ranks(early_receives, 1.0)
    assert sent_s < 0.5
    assert torch.equal(received[0], torch.arange(12.0).view(3, 4))
    assert torch.equal(received[1], -torch.arange(8.0).view(2, 4))


def test_a_receive_posted_for_other_rows_is_an_error():
    from minillm.distributed.pipeline import EarlyReceives

    class Posting:
        rank = 1

        def irecv(self, x, src):
            return None

    receives = EarlyReceives(Posting(), 4, torch.float32, "cpu")
    receives.post([[Chunk(3)]])
    with pytest.raises(RuntimeError, match="posted a receive of 3 rows for a batch of 2"):
        receives.take(2)


def test_run_bubble_of_batches_in_flight():
    # two stages, three batches of 1 s each kept in flight: stage 0 works in [0, 3], stage 1
    # in [1, 4]; the pipeline fills and drains once: (p - 1) / (n + p - 1) = 1/4
    first = [StageTiming(1, 1.0, float(k), float(k + 1)) for k in range(3)]
    last = [StageTiming(1, 1.0, float(k), float(k + 2)) for k in range(3)]
    assert run_bubble([first, last]) == pytest.approx(bubble_fraction(2, 3))
    # the same batches drained one step at a time: each step idles 1/2
    drained = [
        [StageTiming(1, 1.0, 2.0 * k, 2.0 * k + 1) for k in range(3)],
        [StageTiming(1, 1.0, 2.0 * k, 2.0 * k + 2) for k in range(3)],
    ]
    assert run_bubble(drained) == pytest.approx(1 / 2)


def test_the_bubble_splits_into_fill_waits_and_gaps_between_steps():
    # batches in flight, 1 s each: stage 1's first call waits 1 s for stage 0's hidden
    # states, and stage 0 ends 1 s before the run does
    first = [StageTiming(1, 1.0, float(k), float(k + 1)) for k in range(3)]
    last = [StageTiming(1, 1.0, 0.0, 2.0), StageTiming(1, 1.0, 2.0, 3.0)]
    last.append(StageTiming(1, 1.0, 3.0, 4.0))
    parts = bubble_parts([first, last])
    assert parts == pytest.approx(
        {"fill_and_drain": 1 / 8, "within_steps": 1 / 8, "between_steps": 0.0}
    )
    assert sum(parts.values()) == pytest.approx(run_bubble([first, last]))
    # each stage waits 0.5 s between its two steps (the engine's round trip)
    first = [StageTiming(1, 1.0, 0.0, 1.0), StageTiming(1, 1.0, 1.5, 2.5)]
    last = [StageTiming(1, 1.0, 0.0, 2.0), StageTiming(1, 1.0, 2.5, 3.5)]
    parts = bubble_parts([first, last])
    assert parts == pytest.approx(
        {"fill_and_drain": 1 / 7, "within_steps": 1 / 7, "between_steps": 1 / 7}
    )
    assert sum(parts.values()) == pytest.approx(run_bubble([first, last])) == 3 / 7
    # the last stage's layers take 1 s and its sampling 0.25 s more: the sampling is its own
    # work, so its steps last 1.25 s busy (not 1 s busy and a 0.25 s gap between steps)
    first = [StageTiming(1, 1.0, float(k), float(k + 1)) for k in range(3)]
    last = [StageTiming(1, 1.25, 0.0, 2.25), StageTiming(1, 1.25, 2.25, 3.5)]
    last.append(StageTiming(1, 1.25, 3.5, 4.75))
    parts = bubble_parts([first, last])
    # span 4.75 s x 2 stages; stage 0 ends 1.75 s early, stage 1 waits 1 s for its first batch
    assert parts == pytest.approx(
        {"fill_and_drain": 1.75 / 9.5, "within_steps": 1 / 9.5, "between_steps": 0.0}
    )
    # which is the schedule of stages of unequal time: 1 - n sum(t) / (p (sum(t) + (n-1) max))
    assert run_bubble([first, last]) == pytest.approx(uneven_bubble_fraction([1.0, 1.25], 3))


@pytest.mark.parametrize(
    "options",
    [
        dict(pipeline_micro_batches=2),  # each step cut in two and drained
        dict(pipeline_batches_in_flight=2),  # two batches of other requests in flight
        dict(pipeline_batches_in_flight=3),
    ],
    ids=["drained", "in_flight_2", "in_flight_3"],
)
def test_several_requests_on_two_stages_match_one_process(options, reference_outputs):
    with LLM(
        dtype="float32", pipeline_parallel_size=2, max_num_batched_tokens=32, **options
    ) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference_outputs
        engine = llm.engine
        assert not engine._batches and not engine.scheduler.held_blocks
        pool = engine.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks


def test_batches_in_flight_hold_other_requests(monkeypatch):
    """Every batch handed to the stages holds requests that no batch still in flight holds,
    and with four requests two batches are in flight at once, two requests each."""
    from minillm.distributed.executor import MultiprocExecutor

    in_flight: list[set[str]] = []
    overlaps, depths = [], []
    submit, collect = MultiprocExecutor.submit_model, MultiprocExecutor.collect_model

    def watched_submit(self, plan):
        ids = plan.seq_ids()
        overlaps.extend(ids & other for other in in_flight)
        in_flight.append(ids)
        depths.append((len(in_flight), len(ids)))
        return submit(self, plan)

    def watched_collect(self):
        in_flight.pop(0)
        return collect(self)

    monkeypatch.setattr(MultiprocExecutor, "submit_model", watched_submit)
    monkeypatch.setattr(MultiprocExecutor, "collect_model", watched_collect)
    with LLM(dtype="float32", pipeline_parallel_size=2, pipeline_batches_in_flight=2) as llm:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not any(overlaps)
    assert (2, 2) in depths  # a second batch of two requests beside the first


@pytest.mark.parametrize("partition", ["4,2", (4, 2), [4, 2]])
def test_a_layer_partition_enters_as_a_tuple(partition):
    from minillm.engine.args import EngineArgs

    args = EngineArgs(device="cpu", pipeline_parallel_size=2, pipeline_layer_partition=partition)
    assert args.pipeline_layer_partition == (4, 2)
    assert args.parallel_config().pipeline_layer_partition == (4, 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(pipeline_layer_partition="3,3"), "only with pipeline_parallel_size > 1"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition="4,2,1"), "names 3 stages"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=(6,)), "names 1 stages"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition="4,0"), "ints >= 1"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition="5,-1"), "ints >= 1"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=(4.0, 2)), "ints >= 1"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=(True, 5)), "ints >= 1"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition="4;2"), "separated by commas"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition="four,two"), "by commas"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=4), "ints >= 1"),
    ],
)
def test_bad_layer_partitions(options, message):
    from minillm.engine.args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(device="cpu", **options)


@pytest.mark.parametrize("partition", ["4,1", "4,3"])
def test_a_layer_partition_must_hold_the_models_layers(partition):
    # the bundled model has 6 layers; the engine refuses before any process starts
    with pytest.raises(ValueError, match=f"holds {sum(map(int, partition.split(',')))} layers; "):
        LLM(dtype="float32", pipeline_parallel_size=2, pipeline_layer_partition=partition)


@pytest.mark.parametrize(
    "options",
    [dict(pipeline_micro_batches=2), dict(pipeline_batches_in_flight=3)],
    ids=["drained", "in_flight_3"],
)
@pytest.mark.parametrize("partition", ["5,1", "1,5"])
def test_an_uneven_split_matches_one_process(options, partition, reference_outputs):
    with LLM(
        dtype="float32",
        pipeline_parallel_size=2,
        pipeline_layer_partition=partition,
        max_num_batched_tokens=32,
        **options,
    ) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference_outputs
        first, last = llm.engine.pipeline_stats()
        assert first and last  # both stages ran every step


def test_bad_batches_in_flight_options():
    from minillm.engine.args import EngineArgs

    with pytest.raises(ValueError, match="only with pipeline_parallel_size > 1"):
        EngineArgs(pipeline_batches_in_flight=2)
    with pytest.raises(ValueError, match="exclude each other"):
        EngineArgs(pipeline_parallel_size=2, pipeline_batches_in_flight=2, pipeline_micro_batches=2)
    with pytest.raises(ValueError, match="pipeline_batches_in_flight must be an int >= 1"):
        EngineArgs(pipeline_parallel_size=2, pipeline_batches_in_flight=0)


@given(st.integers(1, 8), st.integers(1, 64))
def test_bubble_formula_against_a_slot_by_slot_schedule(num_stages, num_items):
    """(p - 1) / (n + p - 1), the formula chapter 8 sets the engine's measured bubble
    against, equals the idle share of a schedule built slot by slot: stage s works on item j
    (a micro-batch of a drained step, or a batch of a run kept in flight) in slot s + j."""
    num_slots = num_items + num_stages - 1
    busy = [[s <= slot < s + num_items for slot in range(num_slots)] for s in range(num_stages)]
    idle = sum(not cell for row in busy for cell in row) / (num_stages * num_slots)
    assert bubble_fraction(num_stages, num_items) == pytest.approx(idle)


def simulate_stages(stage_seconds: list[float], num_items: int) -> tuple[float, float]:
    """Event by event: item j starts on stage s once stage s has finished item j - 1 and
    stage s - 1 has finished item j (hidden states wait between stages). Returns the
    schedule's idle share, and its span."""
    done = [[0.0] * num_items for _ in stage_seconds]
    for s, t in enumerate(stage_seconds):
        for j in range(num_items):
            ready = max(done[s][j - 1] if j else 0.0, done[s - 1][j] if s else 0.0)
            done[s][j] = ready + t
    span = done[-1][-1]
    busy = num_items * sum(stage_seconds)
    return 1.0 - busy / (len(stage_seconds) * span), span


def test_uneven_bubble_formula_by_hand():
    # stage 0 takes 1 s per batch, stage 1 2 s; three batches: stage 0 works in [0, 3],
    # stage 1 in [1, 7]; busy 9 s of 2 x 7
    assert uneven_bubble_fraction([1.0, 2.0], 3) == pytest.approx(1 - 9 / 14)
    assert simulate_stages([1.0, 2.0], 3) == pytest.approx((1 - 9 / 14, 7.0))
    # the slow stage first: stage 0 in [0, 6], stage 1 at 2-3, 4-5, 6-7
    assert uneven_bubble_fraction([2.0, 1.0], 3) == pytest.approx(1 - 9 / 14)
    # equal stages: GPipe's (p - 1) / (n + p - 1)
    assert uneven_bubble_fraction([1.0, 1.0, 1.0], 4) == pytest.approx(2 / 6)


@given(
    st.lists(st.floats(0.01, 10.0), min_size=1, max_size=6),
    st.integers(1, 64),
)
def test_uneven_bubble_formula_against_an_event_simulation(stage_seconds, num_items):
    idle, _ = simulate_stages(stage_seconds, num_items)
    assert uneven_bubble_fraction(stage_seconds, num_items) == pytest.approx(idle, abs=1e-9)


@given(st.integers(1, 8), st.integers(1, 64), st.floats(0.01, 10.0))
def test_uneven_bubble_formula_of_equal_stages_is_gpipes(num_stages, num_items, seconds):
    assert uneven_bubble_fraction([seconds] * num_stages, num_items) == pytest.approx(
        bubble_fraction(num_stages, num_items)
    )
