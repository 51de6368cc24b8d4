"""Expert parallelism over two gloo ranks: MoE shards against transformers' logits, the engine
against itself on one process (tokens, expert load), the all-to-all traffic against the routes,
routing replay, and bad sizes."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from dist_testing import build_moe, moe_sharded_causal_logits, run_on_ranks, save_checkpoint

from minillm import LLM, SamplingParams
from minillm.distributed.executor import WorkerError
from minillm.distributed.expert_parallel import expert_range, token_share
from minillm.distributed.parallel_state import ParallelConfig
from minillm.engine.args import EngineArgs
from minillm.model.config import ModelConfig
from minillm.model.loader import load_model

PROMPTS = ["w3 w4 w5 w6 w7 w8 w9", "w10 w20 w30", "w50 w51 w52 w53 w54 w55 w56 w57 w58 w59 w60"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# Qwen2-MoE: 4 experts, top-2, a shared expert, layer 1 dense: MoE layers 0 and 2
ENGINE_MODEL = dict(hidden_size=32, num_hidden_layers=3, mlp_only_layers=[1], num_experts_per_tok=2)
ENGINE_OPTIONS = dict(dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=16)


def test_token_shares_and_expert_ranges_cover_everything_once():
    for n in range(0, 9):
        for p in (1, 2, 3):
            shares = [token_share(n, r, p) for r in range(p)]
            assert [t for s, e in shares for t in range(s, e)] == list(range(n))
    assert [expert_range(6, r, 2) for r in range(2)] == [(0, 3), (3, 6)]


def test_moe_shards_give_transformers_logits(tmp_path):
    token_ids = torch.tensor([[1, 5, 9, 33, 7, 60, 2, 14, 40, 3, 77]])
    checkpoints, expected = [], []
    for i, arch in enumerate(("mixtral", "qwen2_moe", "qwen3_moe")):
        model = build_moe(arch, seed=10 + i)
        checkpoints.append(str(save_checkpoint(model, tmp_path / arch)))
        with torch.no_grad():
            expected.append(model(token_ids).logits)
    for rank, results in enumerate(run_on_ranks(moe_sharded_causal_logits, checkpoints, token_ids)):
        for i, want in enumerate(expected):
            num_experts = load_model(checkpoints[i], weights=False).config.num_experts
            for mode, (got, calls, experts) in zip(
                ("tp", "ep"), results[2 * i : 2 * i + 2], strict=True
            ):
                torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=(i, mode))
                assert torch.equal(got.argmax(-1), want.argmax(-1)), (i, mode)
                if mode == "ep":  # its own experts, reached through dispatch and combine
                    assert experts == list(range(*expert_range(num_experts, rank, 2)))
                    assert calls["all_to_all"] == 2 * 2  # two per MoE layer, two layers
                else:  # every expert, a slice of each
                    assert experts == list(range(num_experts)) and "all_to_all" not in calls


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    base = build_moe("qwen2_moe", seed=21, **ENGINE_MODEL)
    path = save_checkpoint(base, tmp_path_factory.mktemp("moe"))
    # the same model with a router that disagrees: noise on every router matrix
    perturbed = build_moe("qwen2_moe", seed=21, **ENGINE_MODEL)
    with torch.no_grad():
        for name, param in perturbed.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    perturbed_path = save_checkpoint(perturbed, tmp_path_factory.mktemp("perturbed"))
    return path, perturbed_path


@pytest.fixture(scope="module")
def reference(moe_paths):
    """One process: greedy tokens, expert load and the routes of the run."""
    llm = LLM(str(moe_paths[0]), **ENGINE_OPTIONS)
    llm.engine.clear_parallel_stats()
    llm.engine.start_routing_record()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    trace = llm.engine.stop_routing_record()
    tokens = [o.outputs[0].token_ids for o in outputs]
    return tokens, llm.engine.expert_load(), trace


@pytest.fixture(scope="module")
def ep_engine(moe_paths):
    llm = LLM(
        str(moe_paths[0]), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE_OPTIONS
    )
    yield llm
    llm.shutdown()


def test_expert_parallel_matches_one_process(ep_engine, reference):
    tokens, load, trace = reference
    ep_engine.engine.clear_parallel_stats()
    outputs = ep_engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tokens
    # the same routes: the same number of tokens at every expert
    assert ep_engine.engine.expert_load() == load
    assert sorted(load) == [0, 2]
    num_tokens = sum(len(trace_pass[0]) for trace_pass in trace)
    assert all(sum(counts) == 2 * num_tokens for counts in load.values())


def test_all_to_all_traffic_follows_the_routes(ep_engine):
    hidden, k, moe_layers, layers = 32, 2, 2, 3
    ep_engine.engine.clear_parallel_stats()
    ep_engine.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    records = ep_engine.engine.collective_stats()
    assert any(r.num_tokens > r.num_sampled for r in records)  # prefill and decode steps
    for record in records:
        n, calls, sent = record.num_tokens, record.collectives.calls, record.collectives.bytes
        share = token_share(n, 0, 2)
        own_share = share[1] - share[0]
        # dispatch sends the driver's share of the pairs; combine returns the pairs that
        # came to its experts 0 and 1, from both shares
        received = sum(sum(counts[:2]) for counts in record.expert_load.values())
        assert calls["all_to_all"] == 2 * moe_layers
        assert sent["all_to_all"] == (moe_layers * own_share * k + received) * hidden * 4
        # o_proj in every layer, down_proj of the dense layer, the embedding
        assert calls["all_reduce"] == layers + 1 + 1
        # each MoE layer gathers the token shares; the LM head gathers logits
        assert calls["all_gather"] == moe_layers + (1 if record.num_sampled else 0)


def test_routing_replay_reproduces_the_recorded_run(ep_engine, reference):
    tokens, _, trace = reference
    engine = ep_engine.engine
    engine.start_routing_replay(trace)
    engine.start_routing_record()
    outputs = ep_engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    replayed = engine.stop_routing_record()
    assert engine.stop_routing_replay() == len(trace)
    assert [o.outputs[0].token_ids for o in outputs] == tokens
    assert len(replayed) == len(trace)
    for got, want in zip(replayed, trace, strict=True):
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[layer], want[layer]) for layer in want)


def test_replay_overrides_a_perturbed_router(moe_paths, reference):
    _, _, trace = reference
    llm = LLM(str(moe_paths[1]), **ENGINE_OPTIONS)
    engine = llm.engine
    engine.start_routing_record()
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    own = engine.stop_routing_record()
    # the perturbed router routes differently on its own ...
    assert any(
        not torch.equal(a[layer], b[layer]) for a, b in zip(own, trace, strict=True) for layer in b
    )
    # ... and exactly as recorded when replaying
    engine.start_routing_replay(trace)
    engine.start_routing_record()
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    replayed = engine.stop_routing_record()
    engine.stop_routing_replay()
    for got, want in zip(replayed, trace, strict=True):
        assert all(torch.equal(got[layer], want[layer]) for layer in want)
    # a trace of another schedule is refused, not applied to the wrong tokens
    engine.start_routing_replay(trace[:1])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all("routing replay" in (o.error or "") for o in outputs)
    engine.stop_routing_replay()


def moe_config(**changes) -> ModelConfig:
    cfg = build_moe("qwen3_moe").config.to_dict()
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    return ModelConfig.from_hf_config({**cfg, **changes})


@pytest.mark.parametrize(
    ("parallel", "changes", "message"),
    [
        (ParallelConfig(2, 1, True), dict(num_experts=5), "must divide num_experts"),
        (ParallelConfig(2, 1, False), dict(moe_intermediate_size=33), "moe_intermediate_size"),
        (ParallelConfig(4, 1, True), dict(num_experts=6), "must divide num_experts"),
    ],
)
def test_expert_counts_that_do_not_divide(parallel, changes, message):
    with pytest.raises(ValueError, match=message):
        parallel.check_model(moe_config(**changes))


def test_expert_parallel_needs_experts_and_tensor_parallel_ranks():
    dense = load_model("minillm-stdlib-target", "float32", weights=False).config
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        ParallelConfig(2, 1, True).check_model(dense)
    with pytest.raises(ValueError, match="give tensor_parallel_size >= 2"):
        EngineArgs(device="cpu", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False"):
        EngineArgs(device="cpu", tensor_parallel_size=2, enable_expert_parallel="yes")
    with pytest.raises(ValueError, match="allows at most"):
        EngineArgs(
            device="cpu",
            tensor_parallel_size=(os.cpu_count() or 1) * 2,
            enable_expert_parallel=True,
        )
    llm = LLM("minillm-stdlib-target", dtype="float32")
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        llm.engine.expert_load()


def test_a_dead_expert_rank_stops_the_engine(ep_engine):
    processes = ep_engine.engine.executor.processes
    os.kill(processes[1].pid, signal.SIGKILL)
    # reported as soon as its pipe closes or its exit is seen, whichever comes first
    with pytest.raises(WorkerError, match="rank 1 (died|exited)"):
        ep_engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not any(process.is_alive() for process in processes)
