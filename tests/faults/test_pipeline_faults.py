"""Faults against a pipeline-parallel engine that keeps batches in flight across steps
(`pipeline_batches_in_flight`): an abort of a request whose batch is still in the stages,
Ctrl-C while the engine waits for a batch, and an exception or Ctrl-C while a batch is
planned or processed; a stage that refuses a request or fails once, drained or with batches
in flight, seeded requests among the others; and seeded random scenarios (`scenarios.py`) on
both. Each ends with the other requests' exact tokens, nothing held
(`invariants.leftovers`, and no batch in flight) and a probe request served as a fresh
engine serves it.
"""

from __future__ import annotations

import pytest

from minillm.distributed.executor import MultiprocExecutor
from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams
from tests.engine.tiny_llama import build_tiny_llama
from tests.faults.invariants import assert_healthy, run_all
from tests.faults.scenarios import (
    BASE,
    NUM_LAYERS,
    PIPELINED,
    PROBE_PARAMS,
    PROBE_PROMPT,
    make_env,
    run_scenario,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
REQUESTS = {
    "a": ([5, 17, 42, 9, 77], GREEDY),
    "b": (list(range(20, 44)), GREEDY),
    "c": ([8, 8, 120, 33], SamplingParams(temperature=0, max_tokens=3)),
    "d": ([3, 1, 4, 1, 5, 9, 2, 6], GREEDY),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_faults")
    return make_env(build_tiny_llama(root / "model", num_hidden_layers=NUM_LAYERS))


@pytest.fixture
def engine(env):
    engine = LLMEngine(
        EngineArgs(
            model=env.model_dir, **BASE, pipeline_parallel_size=2, pipeline_batches_in_flight=2
        )
    )
    yield engine
    engine.shutdown()


def assert_clean(engine: LLMEngine, env) -> None:
    assert not engine._batches and engine.executor.batches_in_flight() == 0
    assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)


def test_abort_of_a_request_whose_batch_is_in_flight(engine, env):
    aborted = []

    def abort_b_in_flight():
        if not aborted and any("b" in plan.seq_ids() for plan in engine._batches):
            engine.abort_request("b")
            aborted.append(True)

    final = run_all(engine, REQUESTS, on_step=abort_b_in_flight)
    assert aborted  # b was aborted while a batch holding it was in the stages
    assert final["b"].outputs[0].finish_reason == "abort"
    for request_id in ("a", "c", "d"):
        prompt, params = REQUESTS[request_id]
        assert final[request_id].error is None
        assert [list(c.token_ids) for c in final[request_id].outputs] == env.solo(
            prompt, params, None
        )
    assert_clean(engine, env)


def test_aborting_everything_with_batches_in_flight(engine, env):
    for request_id, (prompt, params) in REQUESTS.items():
        engine.add_request(request_id, prompt, params)
    engine.step()
    assert len(engine._batches) == 1  # two batches were handed out, one taken in
    for request_id in REQUESTS:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(engine, env)


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("collect", KeyboardInterrupt),  # Ctrl-C while waiting for the oldest batch
        ("process", KeyboardInterrupt),
        ("process", RuntimeError),
        ("schedule", KeyboardInterrupt),
        ("schedule", RuntimeError),
    ],
)
def test_a_step_interrupted_with_batches_in_flight_loses_nothing(
    engine, env, monkeypatch, where, error
):
    calls = [0]

    def armed(original):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 4:
                raise error("injected")
            return original(*args, **kwargs)

        return wrapper

    if where == "collect":
        collect = MultiprocExecutor.collect_model
        monkeypatch.setattr(
            MultiprocExecutor, "collect_model", lambda self: armed(lambda: collect(self))()
        )
    elif where == "process":
        engine._process = armed(engine._process)
    else:
        engine.scheduler.schedule_beside = armed(engine.scheduler.schedule_beside)
    final = run_all(engine, REQUESTS, interrupts=(error,))
    assert calls[0] >= 4  # the fault happened
    for request_id, (prompt, params) in REQUESTS.items():
        assert final[request_id].error is None
        assert [list(c.token_ids) for c in final[request_id].outputs] == env.solo(
            prompt, params, None
        )
    assert_clean(engine, env)


POISON = 301  # a token id that only the refused request's prompt holds


def refusing_stage_forward(monkeypatch, when):
    """The first stage raises on a micro-batch for which when(input ids) holds; worker
    processes forked after this inherit it."""
    from minillm.distributed import pipeline

    forward = pipeline.stage_forward

    def faulty(model, inputs, x, kv_caches):
        if x is None and when(inputs.input_ids.tolist()):
            raise RuntimeError("injected stage fault")
        return forward(model, inputs, x, kv_caches)

    monkeypatch.setattr(pipeline, "stage_forward", faulty)


def pipelined_engine(env, options) -> LLMEngine:
    return LLMEngine(EngineArgs(model=env.model_dir, **BASE, pipeline_parallel_size=2, **options))


MODES = [dict(pipeline_micro_batches=2), dict(pipeline_batches_in_flight=2)]


@pytest.mark.parametrize("options", MODES, ids=["drained", "in_flight"])
def test_a_request_a_stage_always_refuses_fails_alone(env, monkeypatch, options):
    refusing_stage_forward(monkeypatch, lambda ids: POISON in ids)
    engine = pipelined_engine(env, options)
    try:
        requests = {**REQUESTS, "bad": ([7, POISON, 9, 11], GREEDY)}
        final = run_all(engine, requests)
        assert "injected stage fault" in final["bad"].error
        assert_each_as_alone(env, final, REQUESTS)
        if options.get("pipeline_batches_in_flight"):
            assert not engine._batches and engine.executor.batches_in_flight() == 0
        assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("options", MODES, ids=["drained", "in_flight"])
def test_a_one_off_stage_fault_costs_no_request_anything(env, monkeypatch, options):
    calls = [0]

    def third_batch(ids):  # counted in the first stage's process
        calls[0] += 1
        return calls[0] == 3

    refusing_stage_forward(monkeypatch, third_batch)
    engine = pipelined_engine(env, options)
    try:
        final = run_all(engine, REQUESTS)
        assert_each_as_alone(env, final, REQUESTS)
        assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)
    finally:
        engine.shutdown()


SEEDED_FORKS = SamplingParams(n=2, temperature=0.8, seed=77, max_tokens=7, ignore_eos=True)


@pytest.mark.parametrize("options", MODES, ids=["drained", "in_flight"])
@pytest.mark.parametrize("at", [2, 3])
def test_a_one_off_stage_fault_draws_nothing_from_seeded_streams(env, monkeypatch, options, at):
    """The first stage raises on a batch with a seeded request; the last stage still samples
    its rows (from zeros) before the engine hears of the fault, and the rerun must draw what
    a clean run draws: the driver puts the streams back to where they were before that step."""
    calls = [0]

    def once(ids):
        calls[0] += 1
        return calls[0] == at

    refusing_stage_forward(monkeypatch, once)
    engine = pipelined_engine(env, options)
    try:
        requests = {
            "forks": (list(range(5, 25)), SEEDED_FORKS),
            "greedy": ([71, 187, 208, 61, 154, 244, 29, 233], GREEDY),
        }
        final = run_all(engine, requests)
        assert_each_as_alone(env, final, requests)
        assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("options", MODES, ids=["drained", "in_flight"])
def test_ctrl_c_while_processing_rewinds_the_seeded_streams_of_the_workers(env, options):
    """The driver rank sampled the step, then Ctrl-C lands while its tokens are processed:
    the step is taken back, and the streams that drew for it go back with it."""
    engine = pipelined_engine(env, options)
    process, calls = engine._process, [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] in (3, 5):
            raise KeyboardInterrupt
        return process(*args, **kwargs)

    engine._process = interrupted
    try:
        seeded = SamplingParams(temperature=0.8, seed=53, max_tokens=7)
        requests = {"forks": (list(range(5, 25)), SEEDED_FORKS), "seeded": ([9, 8, 7], seeded)}
        final = run_all(engine, requests, interrupts=(KeyboardInterrupt,))
        assert calls[0] > 5
        for request_id, (prompt, params) in requests.items():
            assert [list(c.token_ids) for c in final[request_id].outputs] == env.solo(
                prompt, params, None
            )
        engine._process = process
        assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)
    finally:
        engine.shutdown()


# seeds whose scenarios each mix a Ctrl-C with seeded requests, aborts, a one-off stage fault
# or a refused request; soak.py draws pipelined configurations among the others
PIPELINED_SEEDS = {
    "pp_drained_tiny": (1, 3),
    "pp_in_flight": (6, 11),
    "pp_in_flight_radix_tiny": (3, 10),
    "pp_uneven_in_flight_tiny": (5, 17),
}


@pytest.mark.parametrize("config", sorted(PIPELINED))
def test_a_random_fault_scenario_with_pipeline_stages(env, config):
    """Seeded scenarios on two pipeline stages, drained or with batches in flight: aborts, a
    request the first stage refuses, a one-off stage fault and a KeyboardInterrupt among
    requests that share prefixes (soak.py runs many more)."""
    for seed in PIPELINED_SEEDS[config]:
        assert run_scenario(seed, env, config) == []


def assert_each_as_alone(env, final: dict, requests: dict) -> None:
    """Every request finished without an error, with the tokens it gets alone on one process."""
    for request_id, (prompt, params) in requests.items():
        assert final[request_id].error is None
        assert [list(c.token_ids) for c in final[request_id].outputs] == env.solo(
            prompt, params, None
        )
