"""Async scheduling (EngineArgs.async_scheduling) must not change a single output.

The oracle is the same engine without the option, which shares the scheduler, runner and
output processor but runs them in order, one step at a time; for greedy decoding also the
plain causal forward (`greedy_reference`), which shares none of the engine's code.
"""

from __future__ import annotations

import functools
import threading

import pytest
from tiny_llama import build_tiny_llama, greedy_reference

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.model.loader import load_model
from minillm.sampling_params import SamplingParams

SHARED_PREFIX = list(range(40, 60))
PROMPTS = [
    list(range(2, 9)),
    [5],
    list(range(100, 133)),
    SHARED_PREFIX + [7, 8, 9],
    SHARED_PREFIX + [200, 201, 202, 203, 204, 205],
    list(range(300, 316)),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-async"))


@pytest.fixture(scope="module")
def reference(model_dir):
    model = load_model(model_dir).model

    @functools.cache
    def run(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        return greedy_reference(model, list(prompt), max_tokens)

    return run


def make_engine(model_dir, async_scheduling: bool, **kwargs) -> LLMEngine:
    kwargs.setdefault("max_model_len", 128)
    args = EngineArgs(model=model_dir, device="cpu", async_scheduling=async_scheduling, **kwargs)
    return LLMEngine(args)


def run(engine: LLMEngine, prompts, params) -> dict[str, tuple]:
    """Every request's final completions (token ids, text, finish and stop reasons)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i] if isinstance(params, list) else params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = tuple(
                    (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason)
                    for c in output.outputs
                )
    return results


def both(model_dir, prompts, params, **kwargs) -> tuple[dict, dict, LLMEngine]:
    sync = run(make_engine(model_dir, False, **kwargs), prompts, params)
    engine = make_engine(model_dir, True, **kwargs)
    overlapped = run(engine, prompts, params)
    engine.shutdown()
    return sync, overlapped, engine


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        # chunked prefill: long prompts cut into 5-token chunks beside the decodes
        {"max_num_batched_tokens": 5, "enable_chunked_prefill": True},
        {"enable_prefix_caching": True, "block_size": 4},
        # a pool too small for all six: preemption and recomputation
        {"block_size": 4, "num_gpu_blocks": 16, "max_model_len": 64},
    ],
    ids=["plain", "chunked", "prefix-cache", "preemption"],
)
def test_greedy_outputs_equal_the_engine_without_overlap_and_the_reference(
    model_dir, reference, engine_kwargs
):
    sync, overlapped, engine = both(model_dir, PROMPTS, GREEDY, **engine_kwargs)
    assert overlapped == sync
    assert {k: v[0][0] for k, v in overlapped.items()} == {
        str(i): tuple(reference(tuple(p), 12)) for i, p in enumerate(PROMPTS)
    }
    if "num_gpu_blocks" in engine_kwargs:
        assert engine.stats.num_preemptions > 0


def test_prefix_cache_hits_from_earlier_requests_change_nothing(model_dir):
    def twice(async_scheduling: bool) -> tuple[dict, dict, LLMEngine]:
        engine = make_engine(model_dir, async_scheduling, enable_prefix_caching=True, block_size=4)
        return run(engine, PROMPTS, GREEDY), run(engine, PROMPTS[::-1], GREEDY), engine

    first, second, engine = twice(True)
    assert (first, second) == twice(False)[:2]
    # the second round read the first round's blocks: every full prompt block at least
    assert engine.stats.prefix_cache_hits >= sum(len(p) // 4 * 4 for p in PROMPTS) - 4 * 6
    engine.shutdown()


def test_seeded_sampling_max_tokens_and_n_are_unchanged(model_dir):
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=3 + 2 * i, n=1 + i % 2)
        for i in range(len(PROMPTS))
    ]
    sync, overlapped, _ = both(model_dir, PROMPTS, params, max_num_batched_tokens=16)
    assert overlapped == sync
    # max_tokens: each request stopped on its own length
    for i in range(len(PROMPTS)):
        for token_ids, _text, finish_reason, _stop in overlapped[str(i)]:
            assert finish_reason in ("length", "stop")
            assert len(token_ids) <= 3 + 2 * i


def test_stop_strings_found_one_step_late_drop_the_extra_token(model_dir):
    engine = make_engine(model_dir, False)
    prompt = "the quick brown"
    full = run(engine, [prompt], GREEDY)["0"][0][1]
    stops = [full[len(full) // 3 : len(full) // 3 + 2], full[len(full) // 2 : len(full) // 2 + 3]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stops[0]]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stops[1]]),
        GREEDY,
    ]
    prompts = [prompt, prompt, "a block table"]
    sync_engine = make_engine(model_dir, False)
    sync = run(sync_engine, prompts, params)
    async_engine = make_engine(model_dir, True)
    overlapped = run(async_engine, prompts, params)
    assert overlapped == sync

    def rows(engine, request_id):
        return sum(r == request_id for t in engine.stats.trace for r, _n, _kind in t.scheduled)

    # each stopped request was planned once more than without overlap: one dropped row
    assert [rows(async_engine, str(i)) for i in (0, 1)] == [
        rows(sync_engine, str(i)) + 1 for i in (0, 1)
    ]
    for i in (0, 1):
        [(token_ids, text, finish_reason, stop_reason)] = overlapped[str(i)]
        assert (finish_reason, stop_reason) == ("stop", stops[i])
        assert text == full[: full.index(stops[i])]
    # the stopped requests left no blocks behind (their extra row was freed with them)
    assert async_engine.kv_cache_manager.req_to_blocks == {}
    assert async_engine.scheduler.running == [] and async_engine.scheduler.requests == {}


def test_structured_outputs_and_jump_forward_are_unchanged(model_dir):
    from minillm.sampling_params import StructuredOutputsParams

    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            structured_outputs=StructuredOutputsParams(regex="(ab|cd)[0-9]{2,6}x"),
        ),
        SamplingParams(
            temperature=0.8,
            seed=3,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["quick brown", "lazy dog"]),
        ),
        GREEDY,
    ]
    for jump_forward in (False, True):
        sync, overlapped, _ = both(
            model_dir, ["the", "a block", "def main"], params, enable_jump_forward=jump_forward
        )
        assert overlapped == sync
        assert overlapped["1"][0][1] in ("quick brown", "lazy dog")


def test_streamed_outputs_are_the_same_step_by_step(model_dir):
    """Not only the final texts: every step reports the same deltas in the same order."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["e"])

    def stream(async_scheduling: bool) -> list:
        engine = make_engine(model_dir, async_scheduling)
        for i, prompt in enumerate(["the quick", "continuous", [5, 6, 7]]):
            engine.add_request(str(i), prompt, params)
        steps = []
        while engine.has_unfinished_requests():
            steps.append(
                [(o.request_id, o.outputs[0].delta_text, o.finished) for o in engine.step()]
            )
        return steps

    assert stream(True) == stream(False)


def test_abort_between_steps_frees_the_request(model_dir):
    engine = make_engine(model_dir, True)
    engine.add_request("a", [3, 4, 5], GREEDY)
    engine.add_request("b", [6, 7, 8], GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("a")
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].finish_reason
    assert results == {"a": "abort", "b": "length"}
    assert engine.kv_cache_manager.req_to_blocks == {}
    engine.shutdown()


def test_abort_while_a_grammar_request_is_in_the_forward_leaves_no_matcher(model_dir):
    """The abort frees the request's grammar matcher while the next forward, planned before
    it, still samples the request and makes the matcher again; processing that forward frees
    it for good."""
    from minillm.sampling_params import StructuredOutputsParams

    def samples_a_in_flight() -> bool:
        if engine._in_flight is None:
            return False
        plan, _ = engine._in_flight
        return any(seq.request_id == "a" for s in plan.scheduled for seq in s.sampling_seqs)

    # a prompt of three chunks: the plan of its last, the first to sample, is made ahead
    engine = make_engine(model_dir, True, max_num_batched_tokens=16)
    structured = StructuredOutputsParams(regex="[0-9]{4,8}")
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=structured)
    engine.add_request("a", list(range(3, 43)), params)
    engine.add_request("b", [6, 7, 8], GREEDY)
    # the forward that samples "a" first waits until the abort has happened
    aborted, execute = threading.Event(), engine.runner.execute_model

    def execute_after_the_abort(plan):
        if any(seq.request_id == "a" for s in plan.scheduled for seq in s.sampling_seqs):
            assert aborted.wait(timeout=30)
        return execute(plan)

    engine.runner.execute_model = execute_after_the_abort
    while not samples_a_in_flight():
        engine.step()
    engine.abort_request("a")
    aborted.set()
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"a", "b"}
    assert engine.structured_output_manager.matchers == {}
    engine.shutdown()


def test_a_forward_that_fails_in_the_worker_thread_aborts_only_its_request(model_dir, reference):
    poison = 77
    engine = make_engine(model_dir, True)
    forward = engine.model_runner.forward

    def faulty(model_input):  # runs in the forward thread
        if (model_input.input_ids == poison).any():
            raise RuntimeError("the device refused this batch")
        return forward(model_input)

    engine.model_runner.forward = faulty
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, GREEDY)
    engine.add_request("bad", [3, poison, 5], GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    assert outputs["bad"].outputs[0].finish_reason == "abort"
    assert "RuntimeError: the device refused this batch" in outputs["bad"].error
    for i, prompt in enumerate(PROMPTS[:3]):
        assert outputs[str(i)].error is None
        assert outputs[str(i)].outputs[0].token_ids == reference(tuple(prompt), 12)
    assert engine.kv_cache_manager.req_to_blocks == {}
    engine.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"async_scheduling": 1}, "async_scheduling must be True or False"),
        (
            {
                "async_scheduling": True,
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
            },
            "cannot be combined with speculative_config",
        ),
        ({"async_scheduling": True, "tensor_parallel_size": 2}, "runs on one process"),
        ({"async_scheduling": True, "pipeline_parallel_size": 2}, "runs on one process"),
    ],
)
def test_unsupported_combinations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_overlap_bench_times_every_part_and_compares_equal_outputs(model_dir):
    from minillm.lab.overlap_bench import PARTS, Workload, overlap_bench, step_breakdown

    args = EngineArgs(model=model_dir, device="cpu", max_model_len=64)
    workload = Workload(["the quick", "a block table", "def main"], max_tokens=4)
    breakdown = step_breakdown(args, workload, repeats=1)
    # all prompts prefill in the first step, which samples each one's first token
    assert breakdown.num_steps == workload.max_tokens
    assert set(breakdown.parts_s) == {*PARTS, "other"}
    assert all(s >= 0 for s in breakdown.parts_s.values()) and breakdown.parts_s["forward"] > 0
    assert sum(breakdown.parts_s.values()) == pytest.approx(breakdown.step_s, rel=1e-6)
    assert 0 < breakdown.hideable_fraction <= 0.5
    assert breakdown.bound_speedup == pytest.approx(1 / (1 - breakdown.hideable_fraction))
    not_forward = sum(s for name, s in breakdown.parts_s.items() if name != "forward")
    assert breakdown.cpu_s == pytest.approx(not_forward)
    assert breakdown.hideable_fraction == pytest.approx(
        min(not_forward, breakdown.parts_s["forward"]) / breakdown.step_s
    )
    with pytest.raises(ValueError, match="async_scheduling=False"):
        step_breakdown(EngineArgs(model=model_dir, device="cpu", async_scheduling=True), workload)

    result = overlap_bench(args, workload, repeats=2)
    assert result.outputs_equal
    assert len(result.sync_s) == len(result.async_s) == 2
    assert result.sync_steps == result.async_steps == workload.max_tokens
    # every step but the first is planned while the one before it runs
    assert result.planned_ahead_steps == workload.max_tokens - 1
    summary = result.summary()
    assert summary["speedup_sync_over_async"] == pytest.approx(
        summary["sync"]["median_s"] / summary["async"]["median_s"]
    )


def test_engines_share_one_forward_thread_that_outlives_them(model_dir):
    """No forward thread ends while the process runs (one ending while the process forks
    worker processes left them spinning in MKL): every async engine hands its plans to the
    same thread, which is still there after each engine has shut down or been collected."""
    import gc

    def forward_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("minillm-forward")]

    first = make_engine(model_dir, True)
    expected = run(make_engine(model_dir, False), PROMPTS[:3], GREEDY)
    assert run(first, PROMPTS[:3], GREEDY) == expected
    [thread] = forward_threads()
    first.shutdown()
    second = make_engine(model_dir, True)  # two at once, each with its requests in order
    for i, prompt in enumerate(PROMPTS[:3]):
        first.add_request(str(i), prompt, GREEDY)
        second.add_request(str(i), prompt, GREEDY)
    results = [{}, {}]
    while first.has_unfinished_requests() or second.has_unfinished_requests():
        for k, engine in enumerate((first, second)):
            for output in engine.step():
                if output.finished:
                    results[k][output.request_id] = tuple(output.outputs[0].token_ids)
    assert results[0] == results[1] == {i: expected[i][0][0] for i in expected}
    del first, second
    gc.collect()
    assert forward_threads() == [thread] and thread.is_alive()
