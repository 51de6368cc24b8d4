"""Speculative decoding through the engine: greedy output identical to the engine without it,
under batching, chunked prefill, prefix caching, preemption and n > 1; logprobs and penalties
as without it; every block back in the pool at the end; bad configurations refused."""

from __future__ import annotations

import pytest
from spec_models import build_llama, perturbed_copy

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams

VOCAB = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a draft that is the target with noise: it agrees often, not always."""
    root = tmp_path_factory.mktemp("spec-pair")
    target = build_llama(root / "target", VOCAB, seed=0)
    perturbed_copy(target, root / "draft", noise=0.6, seed=1, vocab_size=VOCAB)
    return root / "target", root / "draft"


def run(engine: LLMEngine, prompts, params) -> dict[str, list[list[int]]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = [c.token_ids for c in output.outputs]
    return outputs


def make_engine(model, spec=None, **options) -> LLMEngine:
    return LLMEngine(EngineArgs(model, speculative_config=spec, **options))


PROMPTS = [
    [0, 5, 9, 12, 5, 9, 12, 5, 9],
    [0, 7, 7, 3, 21, 33, 8, 2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
    [0, 11],
    [0, 5, 9, 12, 5, 9, 12, 5, 9, 30, 31],  # shares a prefix with the first
    [0, 60, 61, 62, 63, 60, 61, 62, 63, 60],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

OPTIONS = {
    "batched": {},
    "chunked prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    "no prefix caching": {"enable_prefix_caching": False},
    "preemption": {"num_gpu_blocks": 12, "block_size": 4, "max_model_len": 48},
    "radix": {"prefix_caching_algo": "radix", "block_size": 4},
}


def draft_spec(pair, k=3):
    return {"method": "draft_model", "model": str(pair[1]), "num_speculative_tokens": k}


NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_output_is_the_greedy_output_without_speculation(pair, options, method):
    spec = draft_spec(pair) if method == "draft_model" else NGRAM
    reference = run(make_engine(pair[0], **options), PROMPTS, GREEDY)
    engine = make_engine(pair[0], spec, **options)
    assert run(engine, PROMPTS, GREEDY) == reference
    stats = engine.spec_decode_stats()
    # drafts were both accepted and rejected, so the rollback ran
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    pool = engine.kv_cache_manager.block_pool
    assert engine.kv_cache_manager.req_to_blocks == {}
    assert pool.get_num_free_blocks() == pool.num_blocks
    if options.get("num_gpu_blocks"):
        assert engine.scheduler.num_preemptions > 0


def test_n_greedy_completions_and_stop_tokens(pair):
    params = SamplingParams(n=3, temperature=0, max_tokens=20, stop_token_ids=[17, 23])
    reference = run(make_engine(pair[0]), PROMPTS, params)
    assert run(make_engine(pair[0], draft_spec(pair, k=4)), PROMPTS, params) == reference


def test_penalties_and_min_tokens_count_the_drafts_before_each_position(pair):
    params = SamplingParams(
        temperature=0,
        max_tokens=24,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        min_tokens=6,
        stop_token_ids=[9, 12],
    )
    reference = run(make_engine(pair[0]), PROMPTS, params)
    for spec in (draft_spec(pair), NGRAM):
        assert run(make_engine(pair[0], spec), PROMPTS, params) == reference


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
def test_logprobs_are_the_targets_in_each_logprobs_mode(pair, mode):
    params = SamplingParams(
        temperature=0, max_tokens=12, logprobs=2, ignore_eos=True, repetition_penalty=1.3
    )

    def logprobs(engine):
        engine.add_request("a", PROMPTS[0], params)
        engine.add_request("b", PROMPTS[1], params)
        got = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    got[output.request_id] = output.outputs[0].logprobs
        return got

    reference = logprobs(make_engine(pair[0], logprobs_mode=mode))
    spec = logprobs(make_engine(pair[0], draft_spec(pair), logprobs_mode=mode))
    for request_id, rows in reference.items():
        assert len(spec[request_id]) == len(rows) == 12
        for row, spec_row in zip(rows, spec[request_id], strict=True):
            assert set(row) == set(spec_row)
            for token_id, logprob in row.items():
                value = getattr(logprob, "logprob", logprob)
                spec_value = getattr(spec_row[token_id], "logprob", spec_row[token_id])
                assert spec_value == pytest.approx(value, abs=1e-4)


def test_seeded_sampling_is_reproducible(pair):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=16, seed=7)
    first = run(make_engine(pair[0], draft_spec(pair)), PROMPTS, params)
    again = run(make_engine(pair[0], draft_spec(pair)), PROMPTS[:2], params)
    assert again["0"] == first["0"] and again["1"] == first["1"]


def test_bundled_pair_and_ngram_greedy_match_the_target_alone():
    prompts = ["def fibonacci(n):", "import os\n\n\ndef main():\n    for path in"]
    params = SamplingParams(temperature=0, max_tokens=32)
    reference = run(make_engine("minillm-stdlib-target", dtype="float32"), prompts, params)
    bundled = {"model": "minillm-stdlib-draft", "num_speculative_tokens": 4}
    for spec in (bundled, {"method": "ngram", "num_speculative_tokens": 4}):
        engine = make_engine("minillm-stdlib-target", spec, dtype="float32")
        assert run(engine, prompts, params) == reference
        assert engine.spec_decode_stats().num_accepted_tokens > 0


BAD_CONFIGS = [
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "one of vLLM's"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    (
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 4,
            "prompt_lookup_max": 2,
        },
        "<=",
    ),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}, "unknown keys"),
    (
        {"model": "minillm-stdlib-draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
        "apply only",
    ),
    ("ngram", "must be a dict"),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS)
def test_bad_configs_are_refused_where_they_enter(config, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs("minillm-stdlib-target", speculative_config=config)


def test_ngram_defaults_follow_vllm():
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert (
        args.speculative_config.prompt_lookup_min,
        args.speculative_config.prompt_lookup_max,
    ) == (5, 5)
    only_max = EngineArgs(
        speculative_config={"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert only_max.speculative_config.method == "ngram"
    assert only_max.speculative_config.prompt_lookup_min == 3


def test_a_draft_of_another_vocabulary_is_refused(pair, tmp_path):
    build_llama(tmp_path / "other", VOCAB + 8, seed=3)
    spec = {"model": str(tmp_path / "other"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(pair[0], spec)


def test_min_p_is_refused_with_speculation_and_others_keep_running(pair):
    engine = make_engine(pair[0], NGRAM)
    engine.add_request("ok", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="min_p"):
        engine.add_request("bad", PROMPTS[1], SamplingParams(min_p=0.1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["ok"]


def test_a_failing_request_is_aborted_and_the_speculating_ones_carry_on(pair):
    """The batch fails on one request's prompt while the others speculate: each request is
    run alone (proposing again), the bad one is aborted, the others' output is unchanged."""
    reference = run(make_engine(pair[0]), PROMPTS[:3], GREEDY)
    seen = {t for outs in reference.values() for t in outs[0]} | {t for p in PROMPTS for t in p}
    poison = min(set(range(2, VOCAB)) - seen)  # a token no healthy request ever holds
    for spec in (draft_spec(pair), NGRAM):
        engine = make_engine(pair[0], spec)
        forward = engine.model_runner.forward

        def faulty(model_input, forward=forward):
            ids = model_input.input_ids
            # the bad prompt's three poison tokens in a row (a draft may propose one alone)
            if ((ids[:-2] == poison) & (ids[1:-1] == poison) & (ids[2:] == poison)).any():
                raise RuntimeError("the device refused this batch")
            return forward(model_input)

        engine.model_runner.forward = faulty
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), prompt, GREEDY)
        outputs = {}
        for step in range(200):
            if step == 3:  # the others are decoding by now
                engine.add_request("bad", [0, poison, poison, poison, 5], GREEDY)
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
            if not engine.has_unfinished_requests():
                break
        assert outputs["bad"].outputs[0].finish_reason == "abort"
        assert {i: [c.token_ids for c in outputs[i].outputs] for i in reference} == reference
        assert engine.kv_cache_manager.req_to_blocks == {}
        pool = engine.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_identical_to_the_target_has_every_draft_accepted(pair, tmp_path, temperature):
    """q = p: the coin u * q < p always lands on accept, so every round yields k + 1 tokens,
    and the counters say exactly that."""
    import transformers

    from minillm.llm import LLM

    same = transformers.AutoModelForCausalLM.from_pretrained(pair[0])
    perturbed_copy(same, tmp_path / "same", noise=0.0, seed=0, vocab_size=VOCAB)
    k = 3
    llm = LLM(
        pair[0], speculative_config={"model": str(tmp_path / "same"), "num_speculative_tokens": k}
    )
    # 1 + 4 rounds of k + 1 tokens: no round is cut short by max_tokens
    params = SamplingParams(
        temperature=temperature, max_tokens=1 + 4 * (k + 1), ignore_eos=True, seed=0
    )
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [17, 17]
    stats = llm.spec_decode_stats()
    assert stats.num_drafts == 8 and stats.num_draft_tokens == 8 * k
    assert stats.num_accepted_tokens == 8 * k
    assert stats.num_accepted_tokens_per_pos == [8] * k
    assert stats.acceptance_rate_per_pos == [1.0] * k
    assert stats.mean_acceptance_length == k + 1
    assert stats.tokens_per_target_forward == 2 * (k + 1)  # two requests verified per forward
    assert LLM(pair[0]).spec_decode_stats() is None
