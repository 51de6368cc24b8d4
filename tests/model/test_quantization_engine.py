"""The engine serving quantized models: EngineArgs.quantization applied at load time, and a
GPTQ checkpoint directory loaded by `load_model`."""

import pytest
import torch

from minillm.llm import LLM
from minillm.model.loader import BUNDLED_MODELS_DIR, load_model
from minillm.model.quantization import Int4Linear, quantize_model
from minillm.model.quantization.checkpoint import save_quantized
from minillm.sampling_params import SamplingParams

TARGET = BUNDLED_MODELS_DIR / "minillm-stdlib-target"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "def fibonacci(n):"


def greedy_tokens(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def reference_tokens(model) -> list[int]:
    """Greedy decoding without the engine: the cache-free forward, re-run per token."""
    ids = load_model("minillm-stdlib-target").tokenizer.encode(PROMPT)
    out = []
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            out.append(int(model.forward_causal(torch.tensor([ids + out]))[0, -1].argmax()))
    return out


def test_the_engine_quantizes_at_load_time_and_decodes_like_the_quantized_model():
    llm = LLM("minillm-stdlib-target", dtype="float32", device="cpu", quantization="int4")
    model = llm.engine.model_runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    direct = load_model("minillm-stdlib-target", dtype="float32").model
    quantize_model(direct, "int4")
    assert greedy_tokens(llm) == reference_tokens(direct)


def test_engine_args_check_the_quantization_options():
    with pytest.raises(ValueError, match="quantization must be"):
        LLM("minillm-stdlib-target", device="cpu", quantization="int3")
    with pytest.raises(ValueError, match="group_size"):
        LLM("minillm-stdlib-target", device="cpu", quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="apply only with quantization"):
        LLM("minillm-stdlib-target", device="cpu", quantization_method="gptq")


def test_the_engine_serves_a_gptq_checkpoint(tmp_path):
    loaded = load_model("minillm-stdlib-target", dtype="float32")
    quantize_model(loaded.model, "int4")
    save_quantized(loaded.model, loaded.config, TARGET, tmp_path, "gptq")
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert greedy_tokens(llm) == reference_tokens(loaded.model)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(tmp_path), dtype="float32", device="cpu", quantization="int8")
