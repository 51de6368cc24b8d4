"""The traced decode forward on a CPU: the eager engine's outputs bit for bit, one trace for
every batch size and context, and eager steps whenever the model changed under it."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import build_tiny_llama
from torch import nn

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.moe_runs import tiny_moe_config
from minillm.model.llama import LlamaForCausalLM
from minillm.sampling_params import SamplingParams
from minillm.worker.decode_trace import DecodeTrace, can_trace

BASE = dict(device="cpu", dtype="float32", max_model_len=96)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    """Every request's token ids and logprobs, by request id."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = [(list(c.token_ids), c.logprobs) for c in output.outputs]
    return done


def workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(7):
        length = int(torch.randint(1, 40, (), generator=gen))
        prompt = torch.randint(3, 90, (length,), generator=gen).tolist()
        if i % 3 == 0:
            params = SamplingParams(temperature=0, max_tokens=9 + 5 * i, ignore_eos=True)
        else:  # seeded sampling, with logprobs: the values must match too
            params = SamplingParams(
                temperature=0.9, seed=i, max_tokens=30, ignore_eos=True, logprobs=2, n=1 + i % 2
            )
        requests.append((prompt, params))
    return requests


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_seqs": 3},  # batches of 1 to 3 sequences
        {"num_gpu_blocks": 24, "block_size": 4},  # preemption and recomputation
        {"async_scheduling": True},
    ],
)
def test_the_traced_engine_gives_the_eager_engines_outputs(model_dir, options):
    traced = LLMEngine(EngineArgs(model=model_dir, **BASE, **options))
    eager = LLMEngine(EngineArgs(model=model_dir, **BASE, **options, enforce_eager=True))
    assert eager.model_runner.decode_trace is None
    for seed in range(2):
        requests = workload(seed)
        assert run(traced, requests) == run(eager, requests)
    assert traced.model_runner.decode_trace.num_replays > 20


def test_one_trace_serves_every_batch_size_and_context_bit_for_bit(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, **BASE, max_num_seqs=4))
    trace = engine.model_runner.decode_trace
    model, kv_caches = engine.model_runner.model, engine.model_runner.kv_caches
    seen = set()
    replay = trace.run

    def checked(ids, positions, meta):
        out = replay(ids, positions, meta)
        # the eager forward on the same step writes the same keys and values again
        assert torch.equal(out, model(ids, positions, kv_caches, meta))
        seen.add((len(ids), meta.torch_plan.decode_mask.shape[-1]))
        return out

    trace.run = checked
    run(engine, workload(3))
    traced_module = trace.traced
    assert traced_module is not None
    assert len({size for size, _ in seen}) >= 3  # batch sizes
    assert len({width for _, width in seen}) >= 3  # gathered context widths
    run(engine, workload(4))
    assert trace.traced is traced_module  # traced once


def decode_steps(engine: LLMEngine, prompt: list[int], tokens: int) -> list[int]:
    done = run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=tokens))])
    return done["r0"][0][0]


def test_a_change_the_trace_cannot_see_sends_decode_steps_back_to_eager(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, **BASE))
    trace = engine.model_runner.decode_trace
    model = engine.model_runner.model
    reference = decode_steps(engine, [5, 6, 7], 8)
    assert (trace.num_traces, trace.num_replays) == (1, 7)  # every step after the prompt's

    def replays_while(change, undo) -> int:
        before = trace.num_replays
        change()
        try:
            decode_steps(engine, [5, 6, 7], 8)
        finally:
            undo()
        return trace.num_replays - before

    mlp = model.model.layers[1].mlp
    calls = []
    handle = []
    assert (
        replays_while(
            lambda: handle.append(mlp.register_forward_hook(lambda *a: calls.append(1))),
            lambda: handle.pop().remove(),
        )
        == 0
    )
    assert len(calls) == 8  # the hook saw every step, decode steps included
    assert (
        replays_while(
            lambda: setattr(mlp, "forward", mlp.forward), lambda: mlp.__dict__.pop("forward")
        )
        == 0
    )
    glob = []
    assert (
        replays_while(
            lambda: glob.append(nn.modules.module.register_module_forward_hook(lambda *a: None)),
            lambda: glob.pop().remove(),
        )
        == 0
    )
    backend = model.model.layers[0].self_attn.backend
    assert (
        replays_while(
            lambda: setattr(backend, "batch_invariant", True),
            lambda: setattr(backend, "batch_invariant", False),
        )
        == 0
    )
    assert trace.num_traces == 1
    # everything as it was: the first trace replays again, with the first run's tokens
    assert decode_steps(engine, [5, 6, 7], 8) == reference
    assert (trace.num_traces, trace.num_replays) == (1, 14)


def test_timers_on_the_layers_see_every_step(model_dir):
    from minillm.lab.step_breakdown import StepRecorder

    engine = LLMEngine(EngineArgs(model=model_dir, **BASE))
    trace = engine.model_runner.decode_trace
    decode_steps(engine, [5, 6, 7], 4)
    replays = trace.num_replays
    recorder = StepRecorder(engine).install()
    try:
        decode_steps(engine, [5, 6, 7], 6)
    finally:
        recorder.uninstall()
    assert trace.num_replays == replays  # the timed steps ran eagerly
    decodes = [s for s in recorder.steps if s.decode_only]
    assert len(decodes) == 5 and all(s.attention_s > 0 and s.linear_s > 0 for s in decodes)
    decode_steps(engine, [5, 6, 7], 4)
    assert trace.num_replays == replays + 3 and trace.num_traces == 1


def test_a_model_changed_for_good_is_traced_again(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, **BASE))
    eager = LLMEngine(EngineArgs(model=model_dir, **BASE, enforce_eager=True))
    trace = engine.model_runner.decode_trace
    decode_steps(engine, [9, 8, 7], 6)
    assert trace.num_traces == 1
    for e in (engine, eager):
        norm = e.model_runner.model.model.norm
        norm.weight = nn.Parameter(-norm.weight.detach())  # a parameter replaced
    assert decode_steps(engine, [9, 8, 7], 12) == decode_steps(eager, [9, 8, 7], 12)
    assert trace.num_traces == 2 and trace.num_replays == 5 + 11
    for e in (engine, eager):
        mlp = e.model_runner.model.model.layers[0].mlp
        down = nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
        with torch.no_grad():
            down.weight.copy_(mlp.down_proj.weight * 0.5)
        mlp.down_proj = down  # a child module replaced
    assert decode_steps(engine, [9, 8, 7], 12) == decode_steps(eager, [9, 8, 7], 12)
    assert trace.num_traces == 3 and trace.num_replays == 5 + 11 + 11


def test_no_trace_where_a_replay_could_not_record_the_step(model_dir):
    def runner(**options):
        return LLMEngine(EngineArgs(model=model_dir, **BASE, **options)).model_runner

    assert runner().decode_trace is not None
    assert runner(enforce_eager=True).decode_trace is None
    assert runner(batch_invariant=True).decode_trace is None
    assert runner(enable_lora=True, max_lora_rank=8).decode_trace is None
    assert runner(kv_cache_dtype="fp8_e4m3").decode_trace is None
    moe = LlamaForCausalLM(tiny_moe_config(97))
    assert not can_trace(moe, [torch.zeros(2, 4, 16, 2, 8)])
    with pytest.raises(ValueError, match="dense model with the torch attention backend"):
        DecodeTrace(moe, [torch.zeros(2, 4, 16, 2, 8)], 16)


def test_no_replay_while_gradients_are_recorded(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, **BASE))
    runner = engine.model_runner
    decode_steps(engine, [4, 4, 4], 5)
    before = runner.decode_trace.num_replays
    with torch.enable_grad():
        assert not runner.decode_trace.can_run(torch.tensor([1]), _decode_meta(runner, engine))
    assert runner.decode_trace.num_replays == before


def _decode_meta(runner, engine):
    from minillm.worker.model_runner import prepare_inputs

    class Chunk:
        num_computed_tokens, num_new_tokens, samples = 3, 1, True
        block_ids = [0]
        token_ids = [4]

    return prepare_inputs([Chunk()], runner.block_size, runner.device, [[4]]).meta


def test_a_quantized_model_decodes_eagerly_with_the_same_tokens(model_dir):
    from minillm.model.quantization import quantize_model

    engines = [
        LLMEngine(EngineArgs(model=model_dir, **BASE, enforce_eager=eager))
        for eager in (False, True)
    ]
    for engine in engines:
        quantize_model(engine.model_runner.model, "int8", 32, "rtn", None, True)
    assert decode_steps(engines[0], [9, 8, 7], 10) == decode_steps(engines[1], [9, 8, 7], 10)
    assert engines[0].model_runner.decode_trace.num_traces == 0


def test_a_model_the_tracer_cannot_record_decodes_eagerly_until_it_changes(model_dir, monkeypatch):
    engine = LLMEngine(EngineArgs(model=model_dir, **BASE))
    eager = LLMEngine(EngineArgs(model=model_dir, **BASE, enforce_eager=True))
    trace = engine.model_runner.decode_trace
    attempts = []
    real_trace = torch.jit.trace

    def refuse(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("an operator the tracer cannot record")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    assert decode_steps(engine, [5, 6, 7], 9) == decode_steps(eager, [5, 6, 7], 9)
    assert len(attempts) == 1 and trace.num_traces == 0 and trace.num_replays == 0
    monkeypatch.setattr(torch.jit, "trace", real_trace)
    decode_steps(engine, [5, 6, 7], 4)
    assert trace.num_traces == 0  # the same model: not tried again
    for e in (engine, eager):
        norm = e.model_runner.model.model.norm
        norm.weight = nn.Parameter(norm.weight.detach() * 1.5)
    assert decode_steps(engine, [5, 6, 7], 9) == decode_steps(eager, [5, 6, 7], 9)
    assert trace.num_traces == 1 and trace.num_replays == 8
