"""Faults and bad input: each is a clear error, nothing is lost, the engine serves on.

Every test here failed on the engine before its fault handling: a bad request raised inside a
step and broke every later step, an aborted id could not be reused, a stream waited forever
when another call ran the engine, an interrupted call left its requests holding blocks. The
last tests mix all of it at random and check that every valid request still gets exactly the
output it gets alone, and that the KV pool ends empty.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_llama import build_tiny_llama

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.llm import LLM
from minillm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
POISON = 299  # a token id the faulty forward below refuses
PROMPTS = [[3, 4, 5, 6], [7, 8], list(range(20, 41)), [9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_engine(model_dir, **options) -> LLMEngine:
    options = {"max_model_len": 64, "max_num_batched_tokens": 16, **options}
    return LLMEngine(EngineArgs(model=model_dir, device="cpu", **options))


def drain(engine: LLMEngine) -> dict[str, object]:
    """Step until idle; the final output of every request, by id."""
    final = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return final
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    raise AssertionError("the engine never became idle")


def pool_is_empty(engine: LLMEngine) -> bool:
    pool = engine.kv_cache_manager.block_pool
    return (
        pool.get_num_free_blocks() == pool.num_blocks
        and not engine.kv_cache_manager.req_to_blocks
        and not engine.scheduler.requests
        and not engine.output_processor.states
    )


@pytest.fixture(scope="module")
def solo(model_dir):
    """Each request's completions when it runs alone on a fresh engine."""
    engine = make_engine(model_dir)
    cache: dict[tuple, tuple[tuple[int, ...], ...]] = {}

    def run(prompt: tuple[int, ...], params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        key = (prompt, repr(params))
        if key not in cache:
            engine.add_request("solo", list(prompt), params)
            output = drain(engine)["solo"]
            cache[key] = tuple(tuple(c.token_ids) for c in output.outputs)
        return cache[key]

    return run


def poison_forward(engine: LLMEngine) -> None:
    """Make the model runner fail on any batch that contains the POISON token."""
    runner = engine.model_runner
    forward = runner.forward

    def faulty(model_input):
        if (model_input.input_ids == POISON).any():
            raise RuntimeError("the device refused this batch")
        return forward(model_input)

    runner.forward = faulty


@contextlib.contextmanager
def time_limit(seconds: int):
    """Turn a hang into a failure (the main thread's alarm)."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---- bad input is refused where it enters ----


@pytest.mark.parametrize(
    ("params", "priority", "message"),
    [
        (SamplingParams(stop_token_ids=[320], min_tokens=2), 0, r"stop_token_ids must be in \[0"),
        (SamplingParams(stop_token_ids=[10**6]), 0, r"stop_token_ids must be in \[0"),
        (GREEDY, "high", "priority must be an int"),
        (GREEDY, True, "priority must be an int"),
        (GREEDY, 1.5, "priority must be an int"),
    ],
)
def test_options_that_need_the_model_are_refused_at_add_request(
    model_dir, params, priority, message
):
    engine = make_engine(model_dir, scheduling_policy="priority")
    engine.add_request("ok", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", PROMPTS[1], params, priority=priority)
    assert list(drain(engine)) == ["ok"]
    assert pool_is_empty(engine)


def test_prompt_dicts_are_prompts(model_dir, solo):
    engine = make_engine(model_dir)
    text = "the quick brown fox"
    ids = engine.tokenizer.encode(text)
    engine.add_request("text", {"prompt": text}, GREEDY)
    engine.add_request("ids", {"prompt_token_ids": ids}, GREEDY)
    outputs = drain(engine)
    assert outputs["text"].prompt == text and outputs["text"].prompt_token_ids == ids
    assert outputs["text"].outputs[0].token_ids == outputs["ids"].outputs[0].token_ids
    assert tuple(outputs["ids"].outputs[0].token_ids) == solo(tuple(ids), GREEDY)[0]
    for bad in ({"prompt": 5}, {"prompt_token_ids": "abc"}, {"text": "x"}, {}):
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request("bad", bad, GREEDY)
    assert pool_is_empty(engine)


def test_a_bad_prompt_withdraws_the_whole_batch(model_dir):
    llm = LLM(str(model_dir), device="cpu", max_model_len=64)
    for bad in ([1.5], "lone surrogate \ud800", [320]):
        with pytest.raises(ValueError):
            llm.generate(["ok", bad], GREEDY, use_tqdm=False)
        assert pool_is_empty(llm.engine)
    assert llm.generate(["ok"], GREEDY, use_tqdm=False)[0].finished


# ---- a step that fails ----


def test_a_step_that_fails_on_one_request_aborts_it_and_serves_the_others(model_dir, solo):
    engine = make_engine(model_dir)
    poison_forward(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.add_request("bad", [3, POISON, 5], GREEDY)
    outputs = drain(engine)
    bad = outputs["bad"]
    assert bad.outputs[0].finish_reason == "abort"
    assert "RuntimeError: the device refused this batch" in bad.error
    for i, prompt in enumerate(PROMPTS):
        assert outputs[str(i)].error is None
        assert (tuple(outputs[str(i)].outputs[0].token_ids),) == solo(tuple(prompt), GREEDY)
    assert pool_is_empty(engine)


def test_a_batch_rerun_request_by_request_skips_the_requests_aborted_meanwhile(model_dir, solo):
    # with pipeline batches in flight, a request can be aborted after its batch was handed
    # to the ranks and before that batch's fault is known; the worker ranks drop its random
    # streams with the next batch, so its rerun must not sample (nobody takes its token)
    engine = make_engine(model_dir)
    for name in ("a", "b"):
        engine.add_request(name, PROMPTS[0], GREEDY)
    plan = engine.scheduler.schedule()
    engine.abort_request("a")
    ran, execute = [], engine.runner.execute_model

    def execute_and_note(alone):
        ran.append([s.request.request_id for s in alone.scheduled])
        return execute(alone)

    engine.runner.execute_model = execute_and_note
    sampled, failed = engine._run_one_by_one(plan, None)
    assert ran == [["b"]] and set(sampled) == {"b"} and failed == []
    engine.scheduler.update_from_output(plan, sampled)
    engine.runner.execute_model = execute
    outputs = drain(engine)
    assert (tuple(outputs["b"].outputs[0].token_ids),) == solo(tuple(PROMPTS[0]), GREEDY)
    assert pool_is_empty(engine)


def test_a_failure_while_detokenizing_loses_no_result_finished_in_the_same_step(model_dir):
    engine = make_engine(model_dir)
    decode = type(engine.tokenizer).decode
    armed = [True]

    def flaky_decode(self, ids, skip_special_tokens=True):
        if armed[0] and POISON in ids:
            armed[0] = False
            raise RuntimeError("a transient detokenizer failure")
        return decode(self, ids, skip_special_tokens)

    engine.tokenizer.decode = flaky_decode.__get__(engine.tokenizer)
    engine.add_request(
        "A", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    )
    engine.add_request("B", [POISON, 5, 6], SamplingParams(temperature=0, max_tokens=3))
    first_step = {o.request_id: o for o in engine.step()}
    assert first_step["A"].finished and first_step["A"].outputs[0].finish_reason == "length"
    assert first_step["B"].finished and "detokenizer failure" in first_step["B"].error
    assert not engine.has_unfinished_requests() and pool_is_empty(engine)


def test_an_interrupted_generate_leaves_nothing_behind(model_dir, solo):
    llm = LLM(str(model_dir), device="cpu", max_model_len=64)
    runner = llm.engine.model_runner
    forward, calls = runner.forward, [0]

    def interrupted(model_input):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return forward(model_input)

    runner.forward = interrupted
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0], PROMPTS[1]], long, use_tqdm=False)
    runner.forward = forward
    assert pool_is_empty(llm.engine)
    [output] = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)
    assert (tuple(output.outputs[0].token_ids),) == solo(tuple(PROMPTS[2]), GREEDY)


def test_an_interrupted_copy_on_write_is_redone(model_dir, solo):
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, ignore_eos=True)
    copy_blocks, armed = engine.model_runner.copy_blocks, [True]

    def interrupted(copies):
        if armed[0] and copies:
            armed[0] = False
            raise KeyboardInterrupt
        return copy_blocks(copies)

    engine.model_runner.copy_blocks = interrupted
    engine.add_request("c", PROMPTS[0], params)
    final = None
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        try:
            for output in engine.step():
                final = output
        except KeyboardInterrupt:
            pass
    assert not armed[0], "the interruption happened"
    assert tuple(tuple(c.token_ids) for c in final.outputs) == solo(tuple(PROMPTS[0]), params)
    assert pool_is_empty(engine)


# ---- ids, streams and threads ----


def test_an_aborted_id_can_be_used_again_before_the_next_step(model_dir, solo):
    engine = make_engine(model_dir)
    engine.add_request("dup", PROMPTS[0], GREEDY)
    engine.step()
    engine.abort_request("dup")
    engine.add_request("dup", PROMPTS[1], GREEDY)
    engine.add_request("other", PROMPTS[2], GREEDY)
    reported = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        reported += [
            (o.request_id, o.outputs[0].finish_reason) for o in engine.step() if o.finished
        ]
    assert reported[0] == ("dup", "abort")
    assert sorted(reported[1:]) == [("dup", "length"), ("other", "length")]
    assert pool_is_empty(engine)


def test_a_stream_gets_its_end_when_another_call_runs_the_engine(model_dir):
    llm = LLM(str(model_dir), device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = llm.generate(["def f"], params, use_tqdm=False)[0].outputs[0].text
    with time_limit(60):
        stream = llm.stream("def f", params)
        pieces = [next(stream).outputs[0].delta_text]
        llm.generate(["the quick"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        outputs = list(stream)
    assert outputs[-1].finished
    assert "".join(pieces + [o.outputs[0].delta_text for o in outputs]) == expected


def test_interleaved_streams_each_get_their_own_full_text(model_dir):
    llm = LLM(str(model_dir), device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["def f", "the quick"]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    with time_limit(60):
        streams = [llm.stream(p, params) for p in prompts]
        texts = ["", ""]
        done = [False, False]
        while not all(done):
            for i, stream in enumerate(streams):
                if not done[i]:
                    output = next(stream)
                    texts[i] += output.outputs[0].delta_text
                    done[i] = output.finished
    assert texts == expected
    assert pool_is_empty(llm.engine)


def test_generate_from_several_threads_at_once(model_dir):
    llm = LLM(str(model_dir), device="cpu", max_model_len=64)
    prompts = ["def f", "the quick", "a block table", "continuous"]
    expected = [o.outputs[0].text for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    got: dict[int, str] = {}

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0].text

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [got[i] for i in range(len(prompts))] == expected
    assert pool_is_empty(llm.engine)


# ---- pool and budget options ----


def test_one_seat_with_the_default_pool_works(model_dir):
    llm = LLM(str(model_dir), device="cpu", max_num_seqs=1)
    outputs = llm.generate(["def f", "the quick"], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]


def test_pools_and_budgets_that_cannot_work_are_refused_at_start(model_dir):
    with pytest.raises(ValueError, match=r"cannot hold one sequence of max_model_len=64"):
        make_engine(model_dir, num_gpu_blocks=3, block_size=16)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        make_engine(model_dir, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="bytes free; ask for fewer blocks"):
        make_engine(model_dir, num_gpu_blocks=10**13)


@pytest.mark.gpu
def test_the_gpu_pool_is_sized_by_gpu_memory_utilization(model_dir):
    small = make_engine(model_dir, device="cuda", gpu_memory_utilization=0.2)
    num_small = small.kv_cache_manager.block_pool.num_blocks
    del small
    torch.cuda.empty_cache()
    large = make_engine(model_dir, device="cuda", gpu_memory_utilization=0.4)
    num_large = large.kv_cache_manager.block_pool.num_blocks
    _free, total = torch.cuda.mem_get_info()
    block_bytes = 16 * large.config.kv_bytes_per_token(2)
    # twice the share of the device: at least the extra 20% of it in blocks, less rounding
    assert num_large - num_small >= int(0.2 * total) // block_bytes - 1


# ---- everything at once ----

VALID_PARAMS = [
    GREEDY,
    SamplingParams(temperature=0, max_tokens=4, stop=["e"], ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0, min_tokens=2, max_tokens=5),
]
INVALID = [
    ([], GREEDY),
    ([3, 400], GREEDY),
    (list(range(2, 80)), GREEDY),
    ([3, 4], SamplingParams(stop_token_ids=[999], min_tokens=1)),
]

operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PROMPTS) - 1), st.integers(0, 4)),
    st.tuples(st.just("invalid"), st.integers(0, len(INVALID) - 1)),
    st.tuples(st.just("poison"), st.integers(0, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


@settings(max_examples=12, deadline=None)
@given(
    operations=st.lists(operation, min_size=1, max_size=25),
    options=st.sampled_from(
        [
            {},
            {"num_gpu_blocks": 12, "block_size": 8},  # preemption
            {"max_num_batched_tokens": 5, "max_num_seqs": 3},  # tiny chunks
            {"enable_prefix_caching": False},
        ]
    ),
)
def test_valid_requests_are_served_as_alone_whatever_happens_around_them(
    model_dir, solo, operations, options
):
    engine = make_engine(model_dir, **options)
    poison_forward(engine)
    added: dict[str, tuple[tuple[int, ...], SamplingParams]] = {}
    poisoned, aborted = set(), set()
    final: dict[str, object] = {}

    def step():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output

    for i, (kind, *args) in enumerate(operations):
        request_id = f"r{i}"
        if kind == "add":
            prompt, params = tuple(PROMPTS[args[0]]), VALID_PARAMS[args[1]]
            engine.add_request(request_id, list(prompt), params)
            added[request_id] = (prompt, params)
        elif kind == "invalid":
            prompt, params = INVALID[args[0]]
            with pytest.raises(ValueError):
                engine.add_request(request_id, prompt, params)
        elif kind == "poison":
            engine.add_request(request_id, [3, POISON, 4], VALID_PARAMS[args[0]])
            poisoned.add(request_id)
        elif kind == "abort" and added:
            victim = sorted(added)[args[0] % len(added)]
            if victim not in final:
                engine.abort_request(victim)
                aborted.add(victim)
        elif kind == "step":
            for _ in range(args[0]):
                step()
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        step()
    for request_id in poisoned:
        assert final[request_id].error is not None
    for request_id, (prompt, params) in added.items():
        output = final[request_id]
        if request_id in aborted:
            assert output.outputs[0].finish_reason in ("abort", "length", "stop")
            continue
        assert output.error is None
        assert tuple(tuple(c.token_ids) for c in output.outputs) == solo(prompt, params)
    assert pool_is_empty(engine)
