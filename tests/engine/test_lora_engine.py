"""Multi-LoRA serving: PEFT-layout adapters applied per row, against merged-weight models.

The oracle for an adapter is the base model with W + scale * B A written into its weights
(merged here, in float32, with no code from minillm.model.lora), run by the plain causal
forward; with peft installed, also peft's PeftModel on transformers' model.
"""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch
from tiny_llama import build_tiny_llama, greedy_reference, random_lora_weights

from minillm import LLM, LoRARequest, SamplingParams
from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.model.loader import load_model
from minillm.model.lora import LoRAManager, LoRASlotsBusy, save_lora_adapter

PROMPTS = [[5, 17, 42, 9, 77, 3, 11], [8, 8, 120, 33, 4, 61, 2], [90, 14, 15, 16, 200, 7, 19]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    """Two adapters on disk (ranks 4 and 8, different targets) and their weights."""
    model = load_model(tiny_dir, "float32").model
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "attn": (("q_proj", "v_proj"), 4, 8.0, 1),
        "all": (
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            8,
            16.0,
            2,
        ),
    }
    out = {}
    for lora_id, (name, (targets, rank, alpha, seed)) in enumerate(specs.items(), start=1):
        weights = random_lora_weights(model, targets, rank, seed)
        path = save_lora_adapter(root / name, weights, alpha)
        out[name] = (LoRARequest(name, lora_id, str(path)), weights, alpha / rank)
    return out


def merged_model(tiny_dir, weights, scale):
    """The oracle: the base model with every adapted weight replaced by W + scale * B A."""
    model = load_model(tiny_dir, "float32").model
    with torch.no_grad():
        for name, (a, b) in weights.items():
            model.get_submodule(name).weight += scale * (b @ a)
    return model


def test_peft_layout_on_disk(adapters):
    request, weights, _ = adapters["attn"]
    config = json.loads(pathlib.Path(request.lora_path, "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    import safetensors.torch

    names = set(safetensors.torch.load_file(f"{request.lora_path}/adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in names
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in names
    assert len(names) == 2 * len(weights) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)


def test_mixed_batch_logits_equal_merged_models(tiny_dir, adapters):
    """One batch of rows on adapter "attn", no adapter and adapter "all": each row's logits
    equal its own merged model's; the base row equals the base model's."""
    model = load_model(tiny_dir, "float32").model
    base = copy.deepcopy(model)
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8)
    for name in ("attn", "all"):
        manager.add_lora(adapters[name][0])
    ids = torch.tensor(PROMPTS)
    seq = ids.shape[1]
    row_adapters = [1, 0, 2]
    manager.set_active([lora for lora in row_adapters for _ in range(seq)], ids.device)
    with torch.no_grad():
        logits = model.forward_causal(ids)
    manager.clear()
    oracles = [
        merged_model(tiny_dir, *adapters["attn"][1:]),
        base,
        merged_model(tiny_dir, *adapters["all"][1:]),
    ]
    with torch.no_grad():
        for row, oracle in enumerate(oracles):
            expected = oracle.forward_causal(ids[row : row + 1])[0]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
        # the adapters matter: a row's logits are far from the base model's
        assert (logits[0] - base.forward_causal(ids[:1])[0]).abs().max() > 0.1
        # with no rows active the hooks leave the model as it was
        torch.testing.assert_close(model.forward_causal(ids), base.forward_causal(ids))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_greedy_tokens_equal_merged_models(tiny_dir, adapters, async_scheduling):
    """Through the engine (paged KV cache, continuous batching): a list of per-prompt
    LoRARequests, mixing both adapters and none, gives each merged model's greedy tokens,
    with async scheduling too (the forward runs in another thread)."""
    llm = LLM(
        tiny_dir,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        async_scheduling=async_scheduling,
    )
    loras = [adapters["attn"][0], None, adapters["all"][0], adapters["all"][0]]
    prompts = PROMPTS + [PROMPTS[0]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    got = [list(out.outputs[0].token_ids) for out in outputs]
    base = load_model(tiny_dir, "float32").model
    oracle = {
        None: base,
        "attn": merged_model(tiny_dir, *adapters["attn"][1:]),
        "all": merged_model(tiny_dir, *adapters["all"][1:]),
    }
    for prompt, lora, tokens in zip(prompts, loras, got, strict=True):
        model = oracle[None if lora is None else lora.lora_name]
        assert tokens == greedy_reference(model, prompt, 8)
    # the adapters matter: the same prompt under an adapter continues differently
    assert got[0] != greedy_reference(base, PROMPTS[0], 8)


@pytest.mark.parametrize("algo", ["hash", "radix"])
def test_prefix_cache_not_shared_across_adapters(tiny_dir, adapters, algo):
    """A prompt cached under one adapter is no hit for another adapter nor the base model;
    with "hash", it is a hit for the same adapter again."""
    engine = LLMEngine(
        EngineArgs(
            tiny_dir,
            dtype="float32",
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            block_size=4,
            prefix_caching_algo=algo,
        )
    )
    prompt = list(range(3, 40))  # 37 tokens: 9 full blocks
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def run(lora):
        before = engine.kv_cache_manager.prefix_cache_stats.num_hit_tokens
        engine.add_request(f"r{run.count}", prompt, params, lora_request=lora)
        run.count += 1
        while engine.has_unfinished_requests():
            engine.step()
        return engine.kv_cache_manager.prefix_cache_stats.num_hit_tokens - before

    run.count = 0
    attn, all_ = adapters["attn"][0], adapters["all"][0]
    assert run(attn) == 0
    assert run(all_) == 0
    assert run(None) == 0
    assert run(None) == 36  # the base model's own prefix: the test can see a hit
    assert run(attn) == (36 if algo == "hash" else 0)


def test_bad_lora_requests_refused_where_they_enter(tiny_dir, adapters, tmp_path):
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/nowhere")
    with pytest.raises(
        ValueError, match=r"lora_int_id must be an int in \[1, 9223372036854775807\]"
    ):
        LoRARequest("x", 2**64, "/nowhere")
    plain = LLM(tiny_dir, dtype="float32")
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([PROMPTS[0]], lora_request=adapters["attn"][0], use_tqdm=False)
    llm = LLM(tiny_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="not a LoRA adapter directory"):
        llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("gone", 7, str(tmp_path / "x")))
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4"):
        llm.generate([PROMPTS[0]], params, lora_request=adapters["all"][0], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_requests for"):
        llm.generate(PROMPTS, params, lora_request=[None], use_tqdm=False)
    with pytest.raises(ValueError, match="LoRARequest"):
        llm.engine.add_request("bad", PROMPTS[0], params, lora_request="attn")
    [out] = llm.generate([PROMPTS[0]], params, lora_request=adapters["attn"][0], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2  # the engine still serves
    # a second adapter evicts the first once no request needs it ...
    other = LoRARequest("other", 9, adapters["attn"][0].lora_path)
    [out] = llm.generate([PROMPTS[0]], params, lora_request=other, use_tqdm=False)
    assert list(llm.engine.lora_manager.adapters) == [9]
    # ... and is refused while an unfinished request still needs the one loaded
    llm.engine.add_request("holds", PROMPTS[1], params, lora_request=other)
    with pytest.raises(LoRASlotsBusy, match="all max_cpu_loras=1 loaded adapters"):
        llm.engine.add_request("refused", PROMPTS[2], params, lora_request=adapters["attn"][0])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineArgs(tiny_dir, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be an int"):
        EngineArgs(tiny_dir, enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="enable_lora=True cannot be combined"):
        EngineArgs(
            tiny_dir,
            enable_lora=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def test_logits_match_peft(tiny_dir, adapters):
    """peft's PeftModel on transformers' model: the independent reading of the same files."""
    peft = pytest.importorskip("peft")
    import transformers

    request, _, _ = adapters["all"]
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, request.lora_path).eval()
    model = load_model(tiny_dir, "float32").model
    manager = LoRAManager(model, max_loras=1, max_lora_rank=8)
    manager.add_lora(request)
    ids = torch.tensor(PROMPTS[:1])
    manager.set_active([request.lora_int_id] * ids.numel(), ids.device)
    with torch.no_grad():
        ours = model.forward_causal(ids)
        theirs = peft_model(input_ids=ids).logits.float()
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert (theirs - base).abs().max() > 0.1  # peft found and applied the adapter's weights


def test_the_least_recently_used_idle_adapter_is_evicted(tiny_dir, adapters, tmp_path):
    model = load_model(tiny_dir, "float32").model
    manager = LoRAManager(model, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    a, b = adapters["attn"][0], adapters["all"][0]
    c = LoRARequest("c", 3, a.lora_path)
    manager.add_lora(a)
    manager.add_lora(b)
    manager.add_lora(a)  # used again: b is now the least recent
    manager.add_lora(c)
    assert list(manager.adapters) == [1, 3]
    assert all(2 not in per_module for per_module in manager.weights.values())
    # an adapter in use is kept even when it is the least recent
    manager.add_lora(b, in_use={1})
    assert list(manager.adapters) == [1, 2]
    with pytest.raises(LoRASlotsBusy, match="are used by unfinished requests"):
        manager.add_lora(c, in_use={1, 2})


@pytest.mark.parametrize("max_loras", [1, 2])
def test_a_step_uses_at_most_max_loras_adapters(tiny_dir, adapters, max_loras):
    """Requests on two adapters and none, with room for one or two adapters per batch: no
    step schedules more adapters than max_loras, and every request gets its merged model's
    greedy tokens."""
    engine = LLMEngine(
        EngineArgs(
            tiny_dir, dtype="float32", enable_lora=True, max_loras=max_loras, max_lora_rank=8,
            max_cpu_loras=2,
        )
    )  # fmt: skip
    steps = []
    schedule = engine.scheduler.schedule

    def recorded():
        output = schedule()
        steps.append({
            s.request.lora_request.lora_int_id
            for s in output.scheduled
            if s.request.lora_request is not None
        })  # fmt: skip
        return output

    engine.scheduler.schedule = recorded
    loras = [adapters["attn"][0], adapters["all"][0], None, adapters["attn"][0]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[1]]
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    got = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                got[output.request_id] = list(output.outputs[0].token_ids)
    assert max(len(step) for step in steps) == max_loras
    oracle = {
        None: load_model(tiny_dir, "float32").model,
        "attn": merged_model(tiny_dir, *adapters["attn"][1:]),
        "all": merged_model(tiny_dir, *adapters["all"][1:]),
    }
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        model = oracle[None if lora is None else lora.lora_name]
        assert got[str(i)] == greedy_reference(model, prompt, 6)


def test_an_id_reused_for_another_adapter_after_eviction_gets_fresh_kv(tiny_dir, adapters):
    """The prefix cache keys an adapter's blocks by the adapter (name and directory), not by
    its lora_int_id: once "attn" is evicted, "all" loaded under attn's id must not read the
    blocks "attn" cached for the same prompt."""
    attn, all_ = adapters["attn"][0], adapters["all"][0]
    all_as_attn = LoRARequest(all_.lora_name, attn.lora_int_id, all_.lora_path)
    other = LoRARequest("other", 5, attn.lora_path)
    prompt = list(range(3, 40))  # 9 full blocks of 4
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4)
    [fresh] = LLM(tiny_dir, **options).generate(
        [prompt], params, lora_request=all_as_attn, use_tqdm=False
    )
    llm = LLM(tiny_dir, max_loras=1, **options)
    [cached] = llm.generate([prompt], params, lora_request=attn, use_tqdm=False)
    llm.generate([[7, 8]], params, lora_request=other, use_tqdm=False)  # evicts attn
    assert attn.lora_int_id not in llm.engine.lora_manager.adapters
    [reused] = llm.generate([prompt], params, lora_request=all_as_attn, use_tqdm=False)
    assert reused.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert cached.outputs[0].token_ids != fresh.outputs[0].token_ids  # the test can fail
    # the same adapter (name and directory) under another id holds the same KV: a hit
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    before = stats.num_hit_tokens
    llm.generate([prompt], params, lora_request=LoRARequest("attn", 6, attn.lora_path))
    assert stats.num_hit_tokens - before == 36


@pytest.mark.parametrize(
    ("config_text", "weights_bytes", "message"),
    [
        ("{not json", None, "cannot read adapter_config.json"),
        ("[1, 2]", None, "must hold a JSON object"),
        (None, b"\x00\x01garbage", "cannot read adapter_model.safetensors"),
    ],
)
def test_a_corrupt_adapter_is_a_value_error(
    tiny_dir, adapters, tmp_path, config_text, weights_bytes, message
):
    """Corrupt files are a bad adapter, refused where it is named, not a library error."""
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapters["attn"][0].lora_path, corrupt)
    if config_text is not None:
        (corrupt / "adapter_config.json").write_text(config_text)
    if weights_bytes is not None:
        (corrupt / "adapter_model.safetensors").write_bytes(weights_bytes)
    llm = LLM(tiny_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0]], lora_request=LoRARequest("corrupt", 3, str(corrupt)))
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_more_adapters_than_max_cpu_loras_in_one_call_are_served_in_turn(
    tiny_dir, adapters, tmp_path
):
    """One generate call over three adapters on an engine that keeps one loaded: the
    requests whose adapter cannot be loaded yet wait and are added as the others finish;
    each gets its merged model's greedy tokens, and the engine is left clean."""
    from tests.faults.invariants import assert_healthy

    llm = LLM(tiny_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    a, b = adapters["attn"][0], adapters["all"][0]
    c = LoRARequest("c", 3, a.lora_path)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[1]]
    loras = [a, b, c, None, b]
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    oracle = {
        None: load_model(tiny_dir, "float32").model,
        "attn": merged_model(tiny_dir, *adapters["attn"][1:]),
        "c": merged_model(tiny_dir, *adapters["attn"][1:]),
        "all": merged_model(tiny_dir, *adapters["all"][1:]),
    }
    for output, prompt, lora in zip(outputs, prompts, loras, strict=True):
        model = oracle[None if lora is None else lora.lora_name]
        assert output.error is None
        assert list(output.outputs[0].token_ids) == greedy_reference(model, prompt, 5)
    # a bad adapter among those held back is refused at once, and nothing of the call runs
    gone = LoRARequest("gone", 7, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a LoRA adapter directory"):
        llm.generate(PROMPTS, params, lora_request=[a, b, gone], use_tqdm=False)
    # so is a bad prompt among them (a token outside the vocabulary)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([PROMPTS[0], PROMPTS[1], [10**6]], params, lora_request=[a, b, None])
    assert not llm.engine.scheduler.requests  # the ones added first were withdrawn
    llm.engine.step()  # which reports them as aborted, to nobody
    probe_prompt = [4, 5, 6]
    fresh = LLM(tiny_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    [expected] = fresh.generate([probe_prompt], params, use_tqdm=False)
    assert_healthy(llm, [list(expected.outputs[0].token_ids)], probe_prompt, params)
