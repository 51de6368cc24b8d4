"""Overlap scheduling (EngineArgs.async_scheduling): step n + 1 is planned while step n's
forward runs, with placeholders for the tokens step n is still sampling.

Two kinds of test. The workload property: on random requests (lengths, arrival steps, greedy
and seeded sampling, stop tokens and stop strings, max_tokens) and engine options (chunked
prefill, prefix caching, a pool small enough to preempt), every output equals the engine's
without the option, which runs the same parts in order. And the mechanism, watched through a
runner that records what each forward gets: the plan ahead is made while the forward runs,
its placeholders hold the previous step's tokens by the time the forward reads them, a
request stopped in step n is in step n + 1's batch and its token is dropped, one that ends by
max_tokens is not, its blocks return to the pool only after step n + 1, and a request with a
penalty makes the engine wait for each step before it plans the next.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_llama import VOCAB_SIZE, build_tiny_llama

from minillm.core.scheduler import PLACEHOLDER_TOKEN_ID
from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-overlap"))


def make_engine(model_dir, async_scheduling: bool, **kwargs) -> LLMEngine:
    kwargs.setdefault("max_model_len", 64)
    args = EngineArgs(model=model_dir, device="cpu", async_scheduling=async_scheduling, **kwargs)
    return LLMEngine(args)


def run(engine: LLMEngine, arrivals: dict[int, list[tuple]]) -> dict[str, tuple]:
    """Add each request at its step; every request's final completions."""
    results, step = {}, 0
    while step <= max(arrivals, default=0) or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = tuple(
                    (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason)
                    for c in output.outputs
                )
        step += 1
    engine.shutdown()
    return results


ENGINE_OPTIONS = [
    {},
    {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},
    {"enable_prefix_caching": True, "block_size": 4},
    {"block_size": 4, "num_gpu_blocks": 12, "max_model_len": 40},  # too small for all: preemption
]
STOP_TOKENS = list(range(100, 140))  # the random model writes one of these now and then

requests = st.lists(
    st.tuples(
        st.lists(st.integers(2, VOCAB_SIZE - 1), min_size=1, max_size=24),  # prompt
        st.integers(0, 4),  # arrival step
        st.integers(1, 14),  # max_tokens
        st.sampled_from(["greedy", "seeded"]),
        st.booleans(),  # stop tokens
        st.sampled_from([[], ["e"], ["th", "a "]]),  # stop strings
        st.sampled_from([{}, {"n": 2}, {"logprobs": 2}, {"repetition_penalty": 1.2}]),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=20)
@given(workload=requests, options=st.sampled_from(range(len(ENGINE_OPTIONS))))
def test_outputs_equal_the_engine_without_overlap(model_dir, workload, options):
    check_equal_outputs(model_dir, workload, ENGINE_OPTIONS[options])


# long enough that a few of them overflow the small pool: preemption, and plans that fall back
long_requests = st.lists(
    st.tuples(
        st.lists(st.integers(2, VOCAB_SIZE - 1), min_size=12, max_size=24),
        st.integers(0, 3),
        st.integers(6, 14),
        st.sampled_from(["greedy", "seeded"]),
        st.booleans(),
        st.sampled_from([[], ["e"]]),
        st.sampled_from([{}, {"n": 2}]),
    ),
    min_size=3,
    max_size=5,
)


@settings(max_examples=8)
@given(workload=long_requests)
def test_outputs_equal_under_preemption(model_dir, workload):
    check_equal_outputs(model_dir, workload, ENGINE_OPTIONS[-1])


def check_equal_outputs(model_dir, workload: list[tuple], kwargs: dict) -> None:
    arrivals: dict[int, list[tuple]] = {}
    for i, (prompt, step, max_tokens, kind, stop_tokens, stop, extra) in enumerate(workload):
        params = SamplingParams(
            temperature=0.0 if kind == "greedy" else 0.9,
            seed=None if kind == "greedy" else 11 + i,
            max_tokens=max_tokens,
            stop_token_ids=STOP_TOKENS if stop_tokens else [],
            stop=stop,
            **extra,  # n > 1 and logprobs overlap; a penalty makes its steps fall back
        )
        arrivals.setdefault(step, []).append((str(i), prompt, params))
    overlapped_engine = make_engine(model_dir, True, **kwargs)
    assert run(overlapped_engine, arrivals) == run(
        make_engine(model_dir, False, **kwargs), arrivals
    )
    assert overlapped_engine.kv_cache_manager.req_to_blocks == {}
    assert overlapped_engine.scheduler.held_blocks == []


def test_a_pool_that_forces_preemption_gives_the_same_outputs(model_dir):
    """Preemption frees blocks, so the engine never preempts while a step is in flight: it
    waits for the step, then plans (and preempts) after it."""
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    arrivals = {0: [(str(i), list(range(10 + 20 * i, 22 + 20 * i)), params) for i in range(4)]}
    kwargs = {"block_size": 4, "num_gpu_blocks": 16, "max_model_len": 48}
    engine = make_engine(model_dir, True, **kwargs)
    plans = watch_plans(engine)
    assert run(engine, arrivals) == run(make_engine(model_dir, False, **kwargs), arrivals)
    preempting = [ahead for _step, ahead, _tokens, preempted in plans if preempted]
    assert preempting and not any(preempting)
    assert sum(ahead for _step, ahead, _tokens, _preempted in plans) > len(plans) // 2


class RecordingRunner:
    """Wraps the model runner: records each plan's input tokens as the forward reads them,
    what it sampled, and the free blocks when it ended."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = engine.runner
        self.inputs: dict[int, dict[str, list[int]]] = {}  # step: {request id: input tokens}
        self.sampled: dict[int, dict[str, int]] = {}  # step: {request id: token}
        self.free_block_ids_at_end: dict[int, set[int]] = {}
        self.pool = engine.kv_cache_manager.block_pool
        engine.runner = self

    def execute_model(self, plan):
        self.inputs[plan.step] = {s.request.request_id: list(s.token_ids) for s in plan.scheduled}
        sampled = self.runner.execute_model(plan)
        self.sampled[plan.step] = {k: v.token_id for k, v in sampled.items()}
        self.free_block_ids_at_end[plan.step] = set(self.pool.free_block_queue)
        return sampled


def watch_plans(engine: LLMEngine) -> list[tuple]:
    """(step, planned ahead, {request id: input tokens as planned}, preempted) per plan;
    planned ahead: made before the previous step's tokens were taken in (update_from_output)."""
    plans, updated = [], set()
    scheduler = engine.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def recorded_schedule():
        plan = schedule()
        tokens = {s.request.request_id: list(s.token_ids) for s in plan.scheduled}
        ahead = plan.step > 0 and plan.step - 1 not in updated
        plans.append((plan.step, ahead, tokens, bool(plan.preempted)))
        return plan

    def recorded_update(plan, sampled):
        updated.add(plan.step)
        return update(plan, sampled)

    scheduler.schedule, scheduler.update_from_output = recorded_schedule, recorded_update
    return plans


def rows(engine: LLMEngine, request_id: str) -> int:
    return sum(r == request_id for t in engine.stats.trace for r, _n, _kind in t.scheduled)


def test_the_next_step_is_planned_while_the_forward_runs(model_dir):
    engine = make_engine(model_dir, True)
    planned_ahead = threading.Event()
    runner = engine.runner
    waited: list[bool] = []

    class BlockingRunner:
        def execute_model(self, plan):
            # step 2's forward waits until step 3 is planned: that needs planning during it
            if plan.step == 2:
                waited.append(planned_ahead.wait(timeout=20))
            return runner.execute_model(plan)

    engine.runner = BlockingRunner()
    schedule = engine.scheduler.schedule

    def recorded():
        plan = schedule()
        if plan.step == 3:
            planned_ahead.set()
        return plan

    engine.scheduler.schedule = recorded
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    result = run(engine, {0: [("a", [3, 4, 5], params), ("b", list(range(20, 30)), params)]})
    assert waited == [True]
    assert {k: len(v[0][0]) for k, v in result.items()} == {"a": 8, "b": 8}


def test_placeholders_are_resolved_from_the_previous_steps_tokens(model_dir):
    engine = make_engine(model_dir, True)
    recorder = RecordingRunner(engine)
    plans = watch_plans(engine)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    run(engine, {0: [("a", [3, 4, 5], params)], 2: [("b", list(range(40, 52)), params)]})
    ahead = [(step, tokens) for step, is_ahead, tokens, _ in plans if is_ahead]
    # every plan but the first is made before the previous step's tokens are taken in
    assert [step for step, _ in ahead] == [step for step, *_ in plans[1:]]
    for step, tokens in ahead:
        for request_id, planned in tokens.items():
            if planned == [PLACEHOLDER_TOKEN_ID]:  # a decode planned ahead
                assert recorder.inputs[step][request_id] == [recorder.sampled[step - 1][request_id]]
            else:  # b's prompt, planned when it arrives
                assert PLACEHOLDER_TOKEN_ID not in planned
    num_placeholders = sum(t == [PLACEHOLDER_TOKEN_ID] for _, ts in ahead for t in ts.values())
    assert num_placeholders == 5 + 5  # every decode of a and b


def test_a_stop_in_step_n_is_in_step_n_plus_1_and_its_blocks_wait_for_it(model_dir):
    """a stops on EOS, found one step late; c ends by max_tokens, known in advance."""
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = {"a": [3, 4, 5, 6, 7], "b": list(range(60, 70)), "c": [9, 10]}
    sync_engine = make_engine(model_dir, False)
    free_run = run(sync_engine, {0: [("a", prompts["a"], long)]})
    eos = free_run["a"][0][0][4]  # a's fifth token, made its EOS: it stops in its fifth step
    stop_params = SamplingParams(temperature=0.0, max_tokens=10)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    arrivals = {0: [("a", prompts["a"], stop_params), ("b", prompts["b"], long)]}
    arrivals[0].append(("c", prompts["c"], short))

    sync_engine = make_engine(model_dir, False)
    sync_engine.eos_token_ids = frozenset({eos})  # read when a request is added
    sync = run(sync_engine, arrivals)
    engine = make_engine(model_dir, True, block_size=4)
    engine.eos_token_ids = frozenset({eos})
    recorder = RecordingRunner(engine)
    blocks_of_a: list[int] = []
    overlapped: dict[str, tuple] = {}
    outputs_by_step: list[set[str]] = []
    free_after_step: list[set[int]] = []
    for request_id, prompt, params in arrivals[0]:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        if "a" in engine.kv_cache_manager.req_to_blocks:
            blocks_of_a = list(engine.kv_cache_manager.get_block_ids("a"))
        finished = [o for o in engine.step() if o.finished]
        for o in finished:
            overlapped[o.request_id] = tuple(
                (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs
            )
        outputs_by_step.append({o.request_id for o in finished})
        free_after_step.append(set(recorder.pool.free_block_queue))
    engine.shutdown()

    assert overlapped == sync
    assert overlapped["a"][0][0] == free_run["a"][0][0][:5]
    assert overlapped["a"][0][2:] == ("stop", None)
    # a sampled EOS in step 4 and was planned into step 5 anyway: one dropped row
    assert rows(engine, "a") == rows(sync_engine, "a") + 1 == 6
    assert "a" in recorder.inputs[5] and "a" in recorder.sampled[5]
    # c's third token was its last by max_tokens: never planned after its step 2
    assert rows(engine, "c") == rows(sync_engine, "c") == 3
    assert "c" not in recorder.inputs[3]
    # a finished in the call that processed step 4, while step 5's forward (which reads its
    # blocks) ran; its blocks stayed out of the pool until that call took step 5's tokens
    finished_at = next(i for i, done in enumerate(outputs_by_step) if "a" in done)
    assert finished_at == 4
    assert not set(blocks_of_a) & recorder.free_block_ids_at_end[5]
    assert not set(blocks_of_a) & free_after_step[finished_at]
    assert set(blocks_of_a) <= free_after_step[finished_at + 1]


def test_a_penalty_in_the_batch_makes_the_engine_plan_after_each_step(model_dir):
    def planned_ahead(arrivals: dict[int, list[tuple]]) -> list[bool]:
        engine = make_engine(model_dir, True)
        plans = watch_plans(engine)
        assert run(engine, arrivals) == run(make_engine(model_dir, False), arrivals)
        return [ahead for _step, ahead, *_ in plans]

    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert planned_ahead({0: [("a", [3, 4, 5], plain), ("b", [7, 8], plain)]}) == [
        False,
        *[True] * 5,
    ]
    longer = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for penalty in ({"repetition_penalty": 1.3}, {"frequency_penalty": 0.5}):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **penalty)
        assert not any(planned_ahead({0: [("a", [3, 4, 5], params), ("b", [7, 8], plain)]}))
        # arriving at step 2: b's first steps overlap, none once the penalty is in the engine
        late = planned_ahead({0: [("b", [7, 8], longer)], 2: [("a", [3, 4, 5], params)]})
        assert late[:3] == [False, True, True] and not any(late[3:])


def test_an_interrupted_step_requeues_both_steps_and_changes_no_output(model_dir):
    """Ctrl-C while step 3 runs (step 4 planned ahead, its placeholders in the requests):
    neither step happened, the requests recompute them, and the outputs are unchanged."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    arrivals = {0: [("a", [3, 4, 5], params), ("b", list(range(20, 31)), params)]}
    engine = make_engine(model_dir, True)
    runner = engine.runner

    class InterruptedRunner:
        interrupted = False

        def execute_model(self, plan):
            if plan.step == 3 and not self.interrupted:
                self.interrupted = True
                raise KeyboardInterrupt
            return runner.execute_model(plan)

    engine.runner = InterruptedRunner()
    for request_id, prompt, p in arrivals[0]:
        engine.add_request(request_id, prompt, p)
    results = {}
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished_requests():
            engine.step()
    assert PLACEHOLDER_TOKEN_ID not in engine.scheduler.requests["a"].all_token_ids
    assert engine.scheduler.running == [] and engine.kv_cache_manager.req_to_blocks == {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = tuple(
                    (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason)
                    for c in output.outputs
                )
    engine.shutdown()
    assert results == run(make_engine(model_dir, False), arrivals)


@pytest.mark.parametrize(
    ("where", "step"),
    [("forward", 3), ("forward", 1), ("processing", 3), ("processing", 1)],
)
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_seeded_request_put_back_by_ctrl_c_does_not_draw_again(
    model_dir, async_scheduling, where, step
):
    """Ctrl-C in step 3's forward (or while its tokens are processed, the step half applied),
    with step 4 planned ahead: the steps put back rewind each seeded sequence's random stream
    to before the first token it did not keep, so its tokens, n = 2 forks included, are
    those of a run without the interruption."""
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=8, ignore_eos=True)
    arrivals = {
        0: [("a", [3, 4, 5], seeded), ("b", list(range(20, 31)), forked)],
        2: [("c", [9, 8, 7, 6], seeded)],
    }
    engine = make_engine(model_dir, async_scheduling)
    fired = []
    if where == "forward":
        runner = engine.runner

        class InterruptedRunner:
            def execute_model(self, plan):
                if plan.step == step and not fired:
                    fired.append(plan.step)
                    # the forward has drawn for this step when the interrupt comes
                    runner.execute_model(plan)
                    raise KeyboardInterrupt
                return runner.execute_model(plan)

        engine.runner = InterruptedRunner()
    else:
        process = engine._process

        def interrupted_process(plan, sampled, failed, *arrived):
            if plan.step == step and not fired:
                fired.append(plan.step)
                # half applied: the tokens reach the requests, then the interrupt comes
                engine.scheduler.update_from_output(plan, sampled)
                raise KeyboardInterrupt
            return process(plan, sampled, failed, *arrived)

        engine._process = interrupted_process
    results, at = {}, 0
    while at <= max(arrivals) or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(at, []):
            engine.add_request(request_id, prompt, params)
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            outputs = []
        for output in outputs:
            if output.finished:
                results[output.request_id] = tuple(
                    (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason)
                    for c in output.outputs
                )
        at += 1
    assert fired == [step]
    assert engine._plan_lengths == {} and engine._plan_generators == {}
    engine.shutdown()
    assert results == run(make_engine(model_dir, False), arrivals)


def test_without_the_rewind_an_interrupted_seeded_request_draws_again(model_dir, monkeypatch):
    """The test above can fail: with the rewind turned off, the same interruption changes a
    seeded request's tokens."""
    monkeypatch.setattr(LLMEngine, "_rewind_generators", lambda self, plans: None)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    arrivals = {0: [("a", [3, 4, 5], seeded)]}
    engine = make_engine(model_dir, True)
    runner = engine.runner
    fired = []

    class InterruptedRunner:
        def execute_model(self, plan):
            if plan.step == 3 and not fired:
                fired.append(plan.step)
                runner.execute_model(plan)
                raise KeyboardInterrupt
            return runner.execute_model(plan)

    engine.runner = InterruptedRunner()
    engine.add_request("a", [3, 4, 5], seeded)
    tokens = None
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            continue
        for output in outputs:
            if output.finished:
                tokens = output.outputs[0].token_ids
    engine.shutdown()
    clean = run(make_engine(model_dir, False), arrivals)["a"][0][0]
    assert fired == [3] and len(tokens) == 10 and tuple(tokens) != clean
