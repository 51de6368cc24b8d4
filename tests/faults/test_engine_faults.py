"""Faults against the public engine API: each attack ends with the engine clean
(`invariants.leftovers`) and a probe request served exactly as a fresh engine serves it.

The targeted tests reproduce one fault each: the radix prefix cache running out of blocks it
counted free, an exception or Ctrl-C while async scheduling plans ahead or processes a step,
a one-off batch fault, and a persistent fault after the random draw. The last test runs one
random scenario (`scenarios.py`) per engine configuration; `python -m tests.faults.soak`
runs many more.
"""

from __future__ import annotations

import pytest

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams
from tests.engine.tiny_llama import build_tiny_llama
from tests.faults.invariants import assert_healthy, leftovers, probe, run_all
from tests.faults.scenarios import (
    BASE,
    CONFIGS,
    PROBE_PARAMS,
    PROBE_PROMPT,
    make_env,
    run_scenario,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return make_env(build_tiny_llama(root / "model"), root)


def make_engine(env, **options) -> LLMEngine:
    return LLMEngine(EngineArgs(model=env.model_dir, **{**BASE, **options}))


def tokens(output) -> list[list[int]]:
    return [list(c.token_ids) for c in output.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_radix_cache_with_a_prefix_computed_twice_under_memory_pressure(env, async_scheduling):
    # two requests compute the same 32-token prompt at once; when the short one finishes,
    # its blocks were counted free though the tree could not evict them, and schedule()
    # raised KeyError on every later step
    engine = make_engine(
        env,
        block_size=4,
        num_gpu_blocks=18,
        prefix_caching_algo="radix",
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    prompt = list(range(100, 132))
    short = SamplingParams(temperature=0, max_tokens=1)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    final = run_all(engine, {"short": (prompt, short), "long": (prompt, long)})
    assert tokens(final["short"]) == env.solo(prompt, short, None)
    assert tokens(final["long"]) == env.solo(prompt, long, None)
    assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("schedule_ahead", KeyboardInterrupt),
        ("schedule_ahead", RuntimeError),
        ("process", KeyboardInterrupt),
        ("process", RuntimeError),
        ("process_sync", KeyboardInterrupt),
        ("process_sync", RuntimeError),
    ],
)
def test_a_step_that_raises_outside_the_forward_loses_nothing(env, where, error):
    """A fault while the next step is planned ahead (async scheduling), or while a step's
    tokens are processed (with and without it): the other requests carry on with exactly
    their own tokens, and nothing is left held."""
    engine = make_engine(env, async_scheduling=where != "process_sync")
    calls = [0]
    if where == "schedule_ahead":
        scheduler, plan = engine.scheduler, engine.scheduler.schedule

        def schedule():
            if scheduler._planning_ahead:
                calls[0] += 1
                if calls[0] == 3:
                    raise error("injected")
            return plan()

        scheduler.schedule = schedule
    else:
        process = engine._process

        def faulty_process(*args):
            calls[0] += 1
            if calls[0] == 3:
                raise error("injected")
            return process(*args)

        engine._process = faulty_process
    requests = {
        "a": ([5, 17, 42, 9, 77], GREEDY),
        "b": (list(range(20, 44)), SEEDED),
        "c": ([8, 8, 120, 33], SamplingParams(temperature=0, max_tokens=3)),
    }
    final = run_all(engine, requests, interrupts=(error,))
    assert calls[0] >= 3  # the fault happened
    for request_id in ("a", "c"):  # greedy: the same whatever step was taken back
        prompt, params = requests[request_id]
        assert final[request_id].error is None
        assert tokens(final[request_id]) == env.solo(prompt, params, None)
    assert final["b"].error is None and len(final["b"].outputs[0].token_ids) == 8
    assert -1 not in final["b"].outputs[0].token_ids  # no placeholder left in a request
    assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_one_off_batch_fault_costs_no_request_anything(env, async_scheduling):
    """The batch fails once; every request run alone succeeds: the step goes on with their
    tokens (nobody aborted), and the seeded request draws exactly what a clean run draws."""
    engine = make_engine(env, async_scheduling=async_scheduling)
    runner, calls = engine.model_runner, [0]
    sample = runner.sample

    def sample_once_faulty(logits, rows):
        calls[0] += 1
        result = sample(logits, rows)  # the draw happened: seeded streams moved on
        if calls[0] == 3:
            raise RuntimeError("a transient fault after the draw")
        return result

    runner.sample = sample_once_faulty
    requests = {"greedy": ([5, 17, 42, 9, 77], GREEDY), "seeded": (list(range(20, 44)), SEEDED)}
    final = run_all(engine, requests)
    assert calls[0] > 3
    for request_id, (prompt, params) in requests.items():
        assert final[request_id].error is None, final[request_id].error
        assert tokens(final[request_id]) == env.solo(prompt, params, None)
    assert not leftovers(engine)


def test_a_persistent_fault_after_the_draw_fails_only_its_request(env):
    engine = make_engine(env)
    runner = engine.model_runner
    sample = runner.sample

    def sample_faulty_for_bad(logits, rows):
        result = sample(logits, rows)
        if any(seq.request_id == "bad" and seq.num_output_tokens >= 2 for r in rows for seq in r):
            raise RuntimeError("per-row post-processing failed")
        return result

    runner.sample = sample_faulty_for_bad
    requests = {
        "greedy": ([5, 17, 42, 9, 77], GREEDY),
        "seeded": (list(range(20, 44)), SEEDED),
        "bad": ([8, 8, 120, 33], GREEDY),
    }
    final = run_all(engine, requests)
    assert final["bad"].outputs[0].finish_reason == "abort"
    assert "RuntimeError: per-row post-processing failed" in final["bad"].error
    for request_id in ("greedy", "seeded"):
        prompt, params = requests[request_id]
        assert final[request_id].error is None
        assert tokens(final[request_id]) == env.solo(prompt, params, None)
    runner.sample = sample
    assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)


def test_the_probe_sees_a_dirty_engine(env):
    # the checker itself: a request left queued, and blocks left held, are both reported
    engine = make_engine(env)
    engine.add_request("left", [5, 6, 7], GREEDY)
    engine.step()
    found = leftovers(engine)
    assert any("req_to_blocks" in line for line in found)
    assert any("scheduler.running" in line for line in found)
    assert any("ref_cnt != 0" in line for line in found)
    engine.abort_request("left")
    engine.step()
    assert not leftovers(engine)
    assert probe(engine, PROBE_PROMPT, PROBE_PARAMS) == env.fresh_probe("plain")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_random_fault_scenario(env, config):
    """One seeded scenario per configuration: aborts, a poisoned request, a one-off fault and
    a KeyboardInterrupt among requests that share prefixes (soak.py runs many)."""
    seed = sorted(CONFIGS).index(config)
    assert run_scenario(seed, env, config) == []


def test_ctrl_c_between_a_step_and_its_queueing_loses_no_streamed_text(env):
    """Ctrl-C in one call just after a step made its outputs, before they reached the
    queues: another call's open stream still gets all its text."""
    from minillm.llm import LLM

    llm = LLM(str(env.model_dir), device="cpu", dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    [reference] = llm.generate(["the quick"], params, use_tqdm=False)
    assert len(reference.outputs[0].text) > 16
    stream = llm.stream("the quick", params)
    text = next(stream).outputs[0].delta_text
    step, calls = llm.engine.step, [0]

    def step_then_interrupt():
        outputs = step()
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt  # the signal lands just after the step returned
        return outputs

    llm.engine.step = step_then_interrupt
    for _ in range(3):  # three calls interrupted, each after its second step
        calls[0] = 0
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["def main"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    llm.engine.step = step
    for output in stream:
        text += output.outputs[0].delta_text
    assert text == reference.outputs[0].text
    assert not leftovers(llm)


def test_a_batch_fault_before_the_copy_on_write_copies_is_redone_with_them(env):
    """The batch raises before the runner made its copy-on-write copies: the requests run
    alone then make them first, and the forks decode from the right keys and values."""
    engine = make_engine(env, block_size=4)
    execute, fired = engine.runner.execute_model, [0]

    def fail_before_copies(plan):
        if plan.block_copies and len(plan.scheduled) > 1 and not fired[0]:
            fired[0] = 1
            raise RuntimeError("a fault before the copies")
        return execute(plan)

    engine.runner.execute_model = fail_before_copies
    forks = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)
    requests = {"forks": ([5, 17, 42, 9, 77, 3], forks), "other": ([8, 8, 120, 33], GREEDY)}
    final = run_all(engine, requests)
    assert fired[0]
    for request_id, (prompt, params) in requests.items():
        assert final[request_id].error is None
        assert tokens(final[request_id]) == env.solo(prompt, params, None)
    assert not leftovers(engine)


@pytest.mark.parametrize("where", ["tracing", "replay"])
def test_a_fault_in_the_traced_decode_forward_costs_no_request_anything(env, where, monkeypatch):
    """The first decode step fails while the forward is being traced: that step and the
    later ones run eagerly. Or a later one fails while a trace replays: the batch is run
    again request by request and the trace replays on. Either way no request is aborted,
    the tokens are the solo engine's, and the engine is left clean."""
    import torch

    from minillm.worker import decode_trace

    requests = {"greedy": ([5, 17, 42, 9, 77], GREEDY), "seeded": (list(range(20, 44)), SEEDED)}
    solo = {rid: env.solo(prompt, params, None) for rid, (prompt, params) in requests.items()}
    engine = make_engine(env)
    trace = engine.model_runner.decode_trace
    assert trace is not None
    calls = [0]
    if where == "tracing":
        real_trace = torch.jit.trace

        def trace_faulty(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("a fault while tracing")
            return real_trace(*args, **kwargs)

        monkeypatch.setattr(decode_trace.torch.jit, "trace", trace_faulty)
    else:
        replay = decode_trace.DecodeTrace.run

        def replay_faulty(self, *args):
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("a fault in a replay")
            return replay(self, *args)

        monkeypatch.setattr(decode_trace.DecodeTrace, "run", replay_faulty)
    final = run_all(engine, requests)
    for request_id in requests:
        assert final[request_id].error is None, final[request_id].error
        assert tokens(final[request_id]) == solo[request_id]
    if where == "tracing":
        assert calls[0] == 1 and trace.num_traces == 0 and trace.refused is not None
    else:
        assert calls[0] >= 5 and trace.num_traces == 1 and trace.num_replays > 5
    assert_healthy(engine, env.fresh_probe("plain"), PROBE_PROMPT, PROBE_PARAMS)
