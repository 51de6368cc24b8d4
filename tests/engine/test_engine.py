"""The engine end to end on a tiny random Llama: scheduling must never change results.

The oracle is `greedy_reference`: the plain causal forward re-run on the whole sequence for
every token (no KV cache, no batching, no scheduler).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_llama import build_tiny_llama, greedy_reference

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.model.loader import load_model
from minillm.sampling_params import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SHARED_PREFIX = list(range(40, 60))
PROMPTS = [
    list(range(2, 9)),  # 7 tokens
    [5],  # 1 token
    list(range(100, 133)),  # 33 tokens: several blocks
    SHARED_PREFIX + [7, 8, 9],  # these two share 20 prompt tokens
    SHARED_PREFIX + [200, 201, 202, 203, 204, 205],
    list(range(300, 316)),  # exactly one block of 16
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model_dir):
    model = load_model(model_dir).model

    @functools.cache
    def run(prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> list[int]:
        return greedy_reference(model, list(prompt), max_tokens)

    return run


def make_engine(model_dir, **kwargs) -> LLMEngine:
    kwargs.setdefault("max_model_len", 128)
    return LLMEngine(EngineArgs(model=model_dir, device="cpu", **kwargs))


def run_all(engine: LLMEngine, prompts, params=GREEDY) -> dict[str, list[list[int]]]:
    """Add the prompts as requests "0", "1", ... at once; step until all are done."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    return finish(engine)


def finish(engine: LLMEngine) -> dict:
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = [c.token_ids for c in output.outputs]
    return results


def expected(reference, prompts) -> dict[str, list[list[int]]]:
    return {str(i): [reference(tuple(p))] for i, p in enumerate(prompts)}


def test_one_request_alone_matches_the_reference(model_dir, reference):
    engine = make_engine(model_dir)
    assert run_all(engine, PROMPTS[:1]) == expected(reference, PROMPTS[:1])


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(),
        dict(max_num_batched_tokens=3),  # chunked prefill, tiny chunks
        dict(max_num_batched_tokens=7, block_size=4),
        dict(max_num_batched_tokens=20, max_num_seqs=2),
        dict(enable_chunked_prefill=False),
        dict(enable_prefix_caching=False, max_num_batched_tokens=16),
        dict(prefix_caching_algo="radix"),
        dict(prefix_caching_algo="radix", max_num_batched_tokens=7, block_size=4),
    ],
    ids=[
        "default",
        "budget3",
        "budget7-block4",
        "budget20-seqs2",
        "no-chunking",
        "no-prefix",
        "radix",
        "radix-budget7-block4",
    ],
)
def test_batching_does_not_change_greedy_outputs(model_dir, reference, engine_kwargs):
    engine = make_engine(model_dir, **engine_kwargs)
    assert run_all(engine, PROMPTS) == expected(reference, PROMPTS)
    if engine_kwargs.get("max_num_batched_tokens", 2048) < 33:
        # the 33-token prompt really was split into chunks
        assert max(engine.stats.num_batched_tokens) <= engine_kwargs["max_num_batched_tokens"]
    assert engine.kv_cache_manager.block_pool.get_num_free_blocks() == (
        engine.kv_cache_manager.block_pool.num_blocks
    )


def test_prefix_cache_hits_do_not_change_outputs(model_dir, reference):
    engine = make_engine(model_dir, block_size=4)
    first = run_all(engine, PROMPTS[3:4])
    # the second prompt arrives after the first finished: its 20 shared tokens are cached
    engine.add_request("again", PROMPTS[4], GREEDY)
    second = finish(engine)
    assert first == {"0": [reference(tuple(PROMPTS[3]))]}
    assert second == {"again": [reference(tuple(PROMPTS[4]))]}
    assert engine.stats.prefix_cache_hits == 20
    assert engine.stats.prefix_cache_hit_rate == 20 / (23 + 26)


def test_forced_preemption_does_not_change_outputs(model_dir, reference):
    # 16 blocks of 4 tokens: one 64-token sequence fits, all six prompts at once do not
    engine = make_engine(model_dir, block_size=4, num_gpu_blocks=16, max_model_len=64)
    assert run_all(engine, PROMPTS) == expected(reference, PROMPTS)
    assert engine.stats.num_preemptions > 0
    assert any(trace.preempted for trace in engine.stats.trace)


@given(
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(2, 40),
    num_blocks=st.integers(8, 40),
    prefix=st.sampled_from([None, "hash", "radix"]),
    prompt_indices=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=5),
)
def test_any_schedule_gives_the_reference_greedy_output(
    model_dir, reference, block_size, budget, num_blocks, prefix, prompt_indices
):
    max_model_len = 48
    num_blocks = max(num_blocks, -(-max_model_len // block_size))
    engine = make_engine(
        model_dir,
        block_size=block_size,
        max_num_batched_tokens=budget,
        num_gpu_blocks=num_blocks,
        enable_prefix_caching=prefix is not None,
        prefix_caching_algo=prefix or "hash",
        max_model_len=max_model_len,
    )
    prompts = [PROMPTS[i] for i in prompt_indices]
    assert run_all(engine, prompts) == expected(reference, prompts)
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_steps_report_progress_and_stats(model_dir):
    ticks = iter(range(1000))
    engine = LLMEngine(
        EngineArgs(model=model_dir, max_model_len=128, max_num_batched_tokens=4),
        clock=lambda: float(next(ticks)),
    )
    engine.add_request("a", list(range(2, 8)), SamplingParams(max_tokens=2, temperature=0))
    first = engine.step()  # 4 of 6 prompt tokens: nothing to report
    assert first == []
    [second] = engine.step()
    assert (second.request_id, second.finished, len(second.outputs[0].token_ids)) == ("a", False, 1)
    [third] = engine.step()
    assert third.finished and third.outputs[0].finish_reason == "length"
    assert engine.stats.num_steps == 3
    assert engine.stats.num_batched_tokens == [4, 2, 1]
    assert [t.scheduled for t in engine.stats.trace] == [
        [("a", 4, "prefill")],
        [("a", 2, "prefill")],
        [("a", 1, "decode")],
    ]
    # clock: add_request 0, admission 1, update 2, update 3 (token 1), update 4 (token 2)
    m = third.metrics
    assert (m.arrival_time, m.first_scheduled_time, m.token_times) == (0.0, 1.0, [3.0, 4.0])
    assert (m.queueing_time_s, m.ttft_s, m.tpot_s, m.e2el_s) == (1.0, 3.0, 1.0, 4.0)
    assert not engine.has_unfinished_requests()


def test_n_completions_share_the_prompt_blocks_and_copy_on_write(model_dir):
    engine = make_engine(model_dir, block_size=4)
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True)
    prompt = list(range(2, 12))  # 10 tokens: the third block is partly filled
    engine.add_request("a", prompt, params)
    engine.step()  # the prompt once, then a#1 and a#2 fork from it
    manager = engine.kv_cache_manager
    tables = [manager.get_block_ids(i) for i in ("a", "a#1", "a#2")]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [manager.block_pool.blocks[b].ref_cnt for b in tables[0]] == [3, 3, 3]
    copies = []
    copy_blocks = engine.model_runner.copy_blocks
    engine.model_runner.copy_blocks = lambda pairs: (copies.extend(pairs), copy_blocks(pairs))
    outputs = finish(engine)["a"]
    # two of the three decode writes into the shared third block copied it first
    assert len(copies) == 2 and {src for src, _ in copies} == {tables[0][2]}
    # completion i draws from seed + i: the same tokens as a lone request with that seed
    for i in range(3):
        alone = make_engine(model_dir, block_size=4)
        lone_params = SamplingParams(seed=11 + i, temperature=1.0, max_tokens=6, ignore_eos=True)
        assert run_all(alone, [prompt], lone_params)["0"] == [outputs[i]]
    assert len({tuple(o) for o in outputs}) > 1  # the completions really differ


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(model_dir):
    params = SamplingParams(n=2, seed=3, temperature=0.8, top_p=0.9, max_tokens=8)
    alone = run_all(make_engine(model_dir), [PROMPTS[0]], params)["0"]
    crowded = run_all(make_engine(model_dir, max_num_batched_tokens=5), PROMPTS[:4], params)
    assert crowded["0"] == alone


def test_bad_requests_are_rejected_and_the_others_finish_unchanged(model_dir, reference):
    engine = make_engine(model_dir, max_model_len=64, max_num_seqs=4)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()
    bad_requests = [
        ("empty", [], GREEDY, "empty"),
        ("long", list(range(2, 66)), GREEDY, "max_model_len=64"),
        ("no-room", list(range(2, 66))[:64], GREEDY, "at most 63 prompt tokens"),
        ("vocab", [3, 320], GREEDY, r"\[0, 320\)"),
        ("negative", [-1], GREEDY, r"\[0, 320\)"),
        ("type", [1.5], GREEDY, "a str, a list of token ids or a prompt dict"),
        ("n", [3], SamplingParams(n=5), "max_num_seqs=4"),
        ("params", [3], {"temperature": 0}, "SamplingParams"),
        ("0", [3], GREEDY, "already in use"),
    ]
    for request_id, prompt, params, message in bad_requests:
        with pytest.raises(ValueError, match=message):
            engine.add_request(request_id, prompt, params)
    assert finish(engine) == expected(reference, PROMPTS[:3])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_abort_reports_the_request_and_frees_its_blocks(model_dir, reference):
    engine = make_engine(model_dir)
    engine.add_request("keep", PROMPTS[0], GREEDY)
    engine.add_request("drop", PROMPTS[2], SamplingParams(n=2, max_tokens=50))
    engine.step()
    engine.abort_request("drop")
    engine.abort_request("unknown")
    outputs = engine.step()
    dropped = [o for o in outputs if o.request_id == "drop"]
    assert len(dropped) == 1 and dropped[0].finished
    assert [c.finish_reason for c in dropped[0].outputs] == ["abort", "abort"]
    assert finish(engine) == {"keep": [reference(tuple(PROMPTS[0]))]}
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_stop_token_ids_and_stop_strings(model_dir, reference):
    engine = make_engine(model_dir)
    tokenizer = engine.tokenizer
    prompt = "the quick brown"
    full = reference(tuple(tokenizer.encode(prompt)), 20)

    stop_token = full[4]
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]
    )
    engine.add_request("tok", prompt, params)
    [completion] = [o for o in iter_outputs(engine) if o.finished][0].outputs
    cut = full.index(stop_token)
    assert completion.token_ids == full[: cut + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)
    assert completion.text == tokenizer.decode(full[:cut])

    # the stop string: three characters from the middle of the unstopped output text
    engine.add_request(
        "full", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    full_text = iter_outputs(engine)[-1].outputs[0].text
    stop_str = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_str])
    engine.add_request("str", prompt, params)
    outputs = iter_outputs(engine)
    completion = outputs[-1].outputs[0]
    assert completion.text == full_text[: full_text.index(stop_str)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_str)
    # streamed pieces add up to the final text and never show part of the stop string
    assert "".join(o.outputs[0].delta_text for o in outputs) == completion.text
    assert all(o.outputs[0].text == completion.text[: len(o.outputs[0].text)] for o in outputs)


def iter_outputs(engine):
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_max_model_len_ends_a_request_without_max_tokens(model_dir):
    engine = make_engine(model_dir, max_model_len=20)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    [output] = [o for o in iter_outputs(engine) if o.finished]
    assert output.outputs[0].finish_reason == "length"
    assert len(PROMPTS[0]) + len(output.outputs[0].token_ids) == 20


def test_logprobs_are_the_raw_model_logprobs(model_dir):
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    engine.add_request("a", PROMPTS[0], params)
    [output] = [o for o in iter_outputs(engine) if o.finished]
    completion = output.outputs[0]
    model = engine.model_runner.model
    with torch.no_grad():
        logits = model.forward_causal(torch.tensor([PROMPTS[0] + completion.token_ids]))
    logprobs = logits[0, len(PROMPTS[0]) - 1 : -1].log_softmax(-1)
    for step, (token_id, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        top2 = logprobs[step].topk(2).indices.tolist()
        assert set(entry) == {token_id, *top2}
        for t, lp in entry.items():
            assert lp == pytest.approx(logprobs[step, t].item(), abs=1e-4)
