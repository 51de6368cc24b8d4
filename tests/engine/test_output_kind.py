"""`SamplingParams.output_kind`: every output so far (CUMULATIVE), only what is new (DELTA),
or one output at the end (FINAL_ONLY), as vLLM's `RequestOutputKind`.

The oracle is the CUMULATIVE run of the same seeded requests: DELTA's pieces must add up to
its outputs, and FINAL_ONLY's one output must equal its last.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from tiny_llama import build_tiny_llama

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.llm import LLM
from minillm.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = ["the quick brown", "a b c d e f", "hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def params_of(kind: RequestOutputKind, stop: list[str] | None = None) -> SamplingParams:
    # sampled, seeded, two completions, logprobs: every part of an output varies
    return SamplingParams(
        n=2, temperature=1.0, seed=7, max_tokens=12, logprobs=2, stop=stop, output_kind=kind
    )


def run(model_dir, kind: RequestOutputKind, stop=None, abort_after: int | None = None) -> dict:
    """Every output of each prompt's request, in order, by request id."""
    engine = LLMEngine(EngineArgs(model=model_dir, device="cpu"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params_of(kind, stop))
    outputs: dict[str, list] = {str(i): [] for i in range(len(PROMPTS))}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
        steps += 1
        if steps == abort_after:
            engine.abort_request("1")
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks  # no block held
    return outputs


def final_completions(outputs: list) -> list[tuple]:
    last = outputs[-1]
    assert last.finished and all(not o.finished for o in outputs[:-1])
    return [(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in last.outputs]


@pytest.fixture(scope="module")
def cumulative(model_dir):
    outputs = run(model_dir, RequestOutputKind.CUMULATIVE)
    # the oracle itself: several outputs per request, each with all text so far
    assert all(len(o) > 2 for o in outputs.values())
    return outputs


def test_final_only_gives_one_output_equal_to_the_last_cumulative_one(model_dir, cumulative):
    final = run(model_dir, RequestOutputKind.FINAL_ONLY)
    for request_id, outputs in final.items():
        assert len(outputs) == 1
        assert final_completions(outputs) == final_completions(cumulative[request_id])


def test_delta_pieces_add_up_to_the_cumulative_outputs(model_dir, cumulative):
    delta = run(model_dir, RequestOutputKind.DELTA)
    for request_id, outputs in delta.items():
        assert len(outputs) == len(cumulative[request_id])
        for index in range(2):
            pieces = [o.outputs[index] for o in outputs]
            whole = [o.outputs[index] for o in cumulative[request_id]]
            # after every output, what was handed out so far is the cumulative output
            for k in range(len(pieces)):
                assert "".join(p.text for p in pieces[: k + 1]) == whole[k].text
                assert sum((p.token_ids for p in pieces[: k + 1]), []) == whole[k].token_ids
                assert sum((p.logprobs for p in pieces[: k + 1]), []) == whole[k].logprobs
                assert pieces[k].delta_text == pieces[k].text
            assert pieces[-1].finish_reason == whole[-1].finish_reason
        # a piece is new: no output repeats tokens
        assert all(0 < len(o.outputs[0].token_ids) for o in outputs[:-1])


def test_delta_with_a_stop_string_hands_out_the_cut_text_once(model_dir, cumulative):
    text = final_completions(cumulative["0"])[0][0]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    whole = run(model_dir, RequestOutputKind.CUMULATIVE, stop=[stop])["0"]
    pieces = run(model_dir, RequestOutputKind.DELTA, stop=[stop])["0"]
    assert "".join(o.outputs[0].text for o in pieces) == whole[-1].outputs[0].text
    assert stop not in whole[-1].outputs[0].text
    assert sum((o.outputs[0].token_ids for o in pieces), []) == whole[-1].outputs[0].token_ids


def test_an_aborted_final_only_request_still_gets_its_one_output(model_dir):
    outputs = run(model_dir, RequestOutputKind.FINAL_ONLY, abort_after=3)
    [aborted] = outputs["1"]
    assert aborted.finished
    assert [c.finish_reason for c in aborted.outputs] == ["abort", "abort"]
    assert all(len(c.token_ids) == 3 for c in aborted.outputs)


@pytest.mark.parametrize("bad", [2, "FINAL_ONLY", None, 2.0])
def test_an_output_kind_that_is_not_one_is_refused_where_it_enters(bad):
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=bad)


def test_generate_asks_for_final_outputs_and_stream_for_every_one(model_dir, cumulative):
    with LLM(model_dir, device="cpu") as llm:
        engine_add = llm.engine.add_request
        kinds = []

        def recording_add(request_id, prompt, params, *args, **kwargs):
            kinds.append(params.output_kind)
            return engine_add(request_id, prompt, params, *args, **kwargs)

        llm.engine.add_request = recording_add
        mine = params_of(RequestOutputKind.DELTA)
        got = llm.generate(PROMPTS, mine, use_tqdm=False)
        assert kinds == [RequestOutputKind.FINAL_ONLY] * len(PROMPTS)
        assert mine.output_kind == RequestOutputKind.DELTA  # the caller's own is untouched
        for i, output in enumerate(got):
            assert final_completions([output]) == final_completions(cumulative[str(i)])

        kinds.clear()
        streamed = list(llm.stream(PROMPTS[0], replace(mine, n=1)))
        assert kinds == [RequestOutputKind.CUMULATIVE]
        assert len(streamed) > 2
        assert "".join(o.outputs[0].delta_text for o in streamed) == streamed[-1].outputs[0].text
