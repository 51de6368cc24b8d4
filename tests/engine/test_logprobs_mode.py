"""logprobs_mode: raw versus processed logprobs, against transformers' logits.

Raw: the model's log-softmax (or logits) before anything the sampler does. Processed: those of
the distribution the token is drawn from, after penalties, temperature, top-k and the grammar
mask, computed here by hand from transformers' logits of the same sequence (-inf where
masked).
"""

import re

import pytest
import torch
from tiny_llama import build_tiny_llama

from minillm import LLM, SamplingParams
from minillm.sampling_params import StructuredOutputsParams

PROMPT = [0, 45, 80, 12, 200, 7]
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-logprobs"))


@pytest.fixture(scope="module")
def hf_logits(model_dir):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).float().eval()

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0, -1].double()

    return logits


@pytest.fixture(scope="module")
def engines(model_dir):
    return {
        mode: LLM(model_dir, device="cpu", logprobs_mode=mode, enforce_eager=True) for mode in MODES
    }


def expected_values(mode: str, raw: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
    return {
        "raw_logprobs": raw.log_softmax(-1),
        "raw_logits": raw,
        "processed_logprobs": processed.log_softmax(-1),
        "processed_logits": processed,
    }[mode]


def check(engine, hf_logits, params, mode, process):
    [output] = engine.generate([PROMPT], params, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) >= 2
    for step, (token, entries) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        context = PROMPT + completion.token_ids[:step]
        raw = hf_logits(context)
        expected = expected_values(mode, raw, process(raw, context))
        assert token in entries
        for t, value in entries.items():
            if expected[t] == float("-inf"):
                assert value == float("-inf")
            else:
                assert value == pytest.approx(float(expected[t]), abs=2e-4), (step, t)
        # besides the sampled token, the entries are the n best by the expected values
        values, ids = expected.topk(params.logprobs)
        best = {int(i) for v, i in zip(values, ids, strict=True) if v != float("-inf")}
        assert best <= set(entries)
        assert len(set(entries) - best - {token}) == params.logprobs - len(best)


@pytest.mark.parametrize("mode", MODES)
def test_sampled_rows_report_raw_or_after_temperature_and_top_k(engines, hf_logits, mode):
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=3, logprobs=4)

    def process(raw, context):
        scaled = raw / 0.7
        kth = scaled.topk(5).values[-1]
        return scaled.masked_fill(scaled < kth, float("-inf"))

    check(engines[mode], hf_logits, params, mode, process)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_rows_report_raw_or_after_the_penalties(engines, hf_logits, mode):
    params = SamplingParams(temperature=0.0, repetition_penalty=1.7, max_tokens=3, logprobs=3)

    def process(raw, context):
        seen = torch.zeros_like(raw, dtype=torch.bool)
        seen[context] = True
        penalized = torch.where(raw > 0, raw / 1.7, raw * 1.7)
        return torch.where(seen, penalized, raw)

    check(engines[mode], hf_logits, params, mode, process)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_processed_logprobs_are_minus_infinity_where_the_grammar_masks(engines, hf_logits, mode):
    engine = engines[mode]
    tokenizer = engine.get_tokenizer()
    vocab_size = engine.engine.config.vocab_size
    # the tokens [a-z]+ allows, found by decoding each token alone (not by our masks)
    letters = torch.tensor(
        [
            re.fullmatch("[a-z]+", tokenizer.decode([t], skip_special_tokens=False)) is not None
            for t in range(vocab_size)
        ]
    )
    constraint = StructuredOutputsParams(regex="[a-z]+")
    params = SamplingParams(
        temperature=0.0, max_tokens=3, logprobs=20, structured_outputs=constraint
    )

    def process(raw, context):
        allowed = letters.clone()
        if len(context) > len(PROMPT):
            allowed[tokenizer.eos_token_id] = True
        return raw.masked_fill(~allowed, float("-inf"))

    check(engine, hf_logits, params, mode, process)
    if mode == "raw_logprobs":  # raw logprobs ignore the mask: disallowed tokens show up
        [output] = engine.generate([PROMPT], params, use_tqdm=False)
        assert any(not letters[t] for t in output.outputs[0].logprobs[0])


def test_bad_logprobs_modes_are_rejected_where_they_enter():
    from minillm import EngineArgs
    from minillm.worker.sampler import Sampler

    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineArgs(logprobs_mode="processed")
    with pytest.raises(ValueError, match="logprobs_mode='raw_logits' runs on one process"):
        EngineArgs(logprobs_mode="raw_logits", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        Sampler(logprobs_mode="logits")
