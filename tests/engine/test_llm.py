"""The public API: LLM.generate, LLM.stream, the package exports and `minillm generate`."""

from __future__ import annotations

import re

import pytest
from tiny_llama import build_tiny_llama, greedy_reference

import minillm
from minillm.cli.main import main
from minillm.engine.args import EngineArgs
from minillm.llm import LLM, as_prompt_list
from minillm.model.loader import DEFAULT_MODEL
from minillm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEXTS = ["the quick brown fox", "def main", "a block table maps", "continuous"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", max_model_len=64, max_num_batched_tokens=8)


def test_generate_returns_outputs_in_prompt_order_matching_the_reference(llm):
    outputs = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    model = llm.engine.model_runner.model
    assert [o.prompt for o in outputs] == TEXTS
    for output in outputs:
        assert output.finished
        assert output.prompt_token_ids == tokenizer.encode(output.prompt)
        [completion] = output.outputs
        assert completion.token_ids == greedy_reference(model, output.prompt_token_ids, 8)
        # the incremental text holds back bytes of an unfinished UTF-8 character (U+FFFD)
        assert completion.text.rstrip("\ufffd") == (
            tokenizer.decode(completion.token_ids).rstrip("\ufffd")
        )
        assert (completion.index, completion.finish_reason) == (0, "length")
        assert output.metrics.ttft_s > 0 and len(output.metrics.itl_s) == 7
    assert not llm.engine.has_unfinished_requests()


def test_generate_takes_token_ids_and_per_prompt_params(llm):
    [single] = llm.generate([5, 6, 7], GREEDY, use_tqdm=False)
    assert single.prompt is None and single.prompt_token_ids == [5, 6, 7]
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], "def"], [short, GREEDY], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == single.outputs[0].token_ids[:2]
    assert len(outputs[1].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [short], use_tqdm=False)


def test_generate_with_a_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    # the prompt queued before the bad one was withdrawn; the engine still serves
    [output] = llm.generate("fine", GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    assert not llm.engine.scheduler.has_unfinished_requests()


def test_generate_n_completions(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5)
    [output] = llm.generate("the quick", params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    [again] = llm.generate("the quick", params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]


def test_stream_yields_deltas_that_add_up_to_the_generated_text(llm):
    [expected] = llm.generate("the quick", GREEDY, use_tqdm=False)
    outputs = list(llm.stream("the quick", GREEDY))
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert len(outputs) == 8  # one output per token
    assert "".join(o.outputs[0].delta_text for o in outputs) == expected.outputs[0].text
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids


def test_closing_a_stream_early_aborts_the_request(llm):
    stream = llm.stream("def main", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.scheduler.has_unfinished_requests()
    pool = llm.engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_a_stream_takes_outputs_another_thread_queued_after_its_empty_take(llm):
    """Another thread may run the steps that finish a stream's request between the stream's
    empty take and its check for lost outputs; the outputs then wait in its queue."""
    [expected] = llm.generate("the quick", GREEDY, use_tqdm=False)
    take = llm._take
    raced = []

    def take_then_other_thread_steps(request_id):
        outputs = take(request_id)
        if not outputs and not raced:  # the other thread runs the request to its end
            raced.append(request_id)
            while request_id in llm.engine.output_processor.states:
                llm._step()
        return outputs

    llm._take = take_then_other_thread_steps
    try:
        outputs = list(llm.stream("the quick", GREEDY))
    finally:
        del llm._take
    assert raced and outputs[-1].finished
    assert "".join(o.outputs[0].delta_text for o in outputs) == expected.outputs[0].text
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests()


def test_as_prompt_list():
    assert as_prompt_list("a") == ["a"]
    assert as_prompt_list([1, 2]) == [[1, 2]]
    assert as_prompt_list(["a", [1, 2]]) == ["a", [1, 2]]


def test_package_exports_the_public_api():
    assert minillm.LLM is LLM
    assert minillm.EngineArgs is EngineArgs
    assert set(minillm.__all__) == {
        "LLM",
        "SamplingParams",
        "LLMEngine",
        "EngineArgs",
        "RequestOutput",
        "CompletionOutput",
        "StructuredOutputsParams",
        "BeamSearchParams",
        "LoRARequest",
    }
    assert EngineArgs().model == DEFAULT_MODEL
    with pytest.raises(AttributeError):
        minillm.NotAName  # noqa: B018


def test_engine_args_are_checked():
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(num_gpu_blocks=8, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(block_size=0)


def test_engine_args_size_the_kv_cache(model_dir):
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(str(model_dir), max_model_len=64, num_gpu_blocks=3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(model_dir), max_model_len=100_000)
    # 2 layers * 2 KV heads * head_dim 8 * (K and V) * 4 bytes = 256 bytes per token
    llm = LLM(str(model_dir), kv_cache_memory_bytes=256 * 16 * 10, max_model_len=64)
    assert llm.engine.kv_cache_manager.block_pool.num_blocks == 10
    llm = LLM(str(model_dir), max_num_seqs=4, max_model_len=64)
    assert llm.engine.kv_cache_manager.num_tokens_capacity == 4 * 64 // 2


def test_generate_command(model_dir, capsys):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    [expected] = LLM(str(model_dir)).generate(["the quick"], greedy, use_tqdm=False)
    # one prompt streams: the printed text is the prompt and the greedy completion
    status = main(["generate", "the quick", "--model", str(model_dir), "--max-tokens", "4"])
    assert status == 0
    captured = capsys.readouterr()
    assert captured.out == "the quick" + expected.outputs[0].text + "\n"
    assert re.fullmatch(
        r"\[4 tokens in [\d.]+ s: TTFT [\d.]+ ms, [\d.]+ tokens/s, TPOT [\d.]+ ms\]\n",
        captured.err,
    )
    # several prompts run as one batch, each with its own timing line
    status = main(["generate", "the quick", "def", "--model", str(model_dir), "--max-tokens", "3"])
    assert status == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("the quick") and "\ndef" in captured.out
    assert captured.err.count("tokens/s") == 2
    status = main(["generate", "", "--model", str(model_dir)])
    assert status == 2
    assert "empty" in capsys.readouterr().err


@pytest.mark.parametrize("prompts", [None, 42, 3.5])
def test_generate_names_a_prompt_that_is_no_prompt(prompts):
    with pytest.raises(ValueError, match="prompts must be a prompt"):
        as_prompt_list(prompts)


def test_options_as_a_dict_are_named_not_iterated(llm):
    with pytest.raises(ValueError, match="got a dict: build SamplingParams"):
        llm.generate(["the"], {"temperature": 0.0}, use_tqdm=False)
    assert llm.generate(["the"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
