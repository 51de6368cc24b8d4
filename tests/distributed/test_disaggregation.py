"""Prefill/decode disaggregation over two gloo ranks: the plan split by phase, greedy outputs
equal to a colocated engine, KV transfer bytes against the cache's layout, the mixed-load
latency measurement, bad options, and a decode rank that dies."""

from __future__ import annotations

import dataclasses
import os
import signal
import types

import pytest
from conftest import GREEDY, PROMPTS

from minillm import LLM, SamplingParams
from minillm.core.scheduler import SchedulerOutput
from minillm.distributed.disaggregation import KVTransferConfig, split_plan
from minillm.distributed.executor import WorkerError
from minillm.engine.args import EngineArgs, kv_cache_block_bytes
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.disagg_bench import run_mixed_load
from minillm.model.config import torch_dtype

KV_TRANSFER = {"kv_connector": "TorchDistributedConnector"}


def chunk(request_id, phase, computed, new, samples, blocks):
    request = types.SimpleNamespace(request_id=request_id)
    return types.SimpleNamespace(
        request=request,
        phase=phase,
        num_computed_tokens=computed,
        num_new_tokens=new,
        samples=samples,
        block_ids=blocks,
    )


def test_split_plan_by_phase_and_the_blocks_that_move():
    plan = SchedulerOutput(
        step=3,
        scheduled=[
            chunk("a", "decode", 20, 1, True, [4, 5]),
            chunk("b", "prefill", 0, 8, False, [1]),  # a chunk short of its prompt's end
            chunk("c", "prefill", 16, 17, True, [7, 2, 9, 8]),  # 33 tokens: 3 blocks of 16
        ],
        block_copies=[(1, 2)],
        finished_req_ids=["z"],
    )
    prefill, decode, transfers = split_plan(plan, block_size=16)
    assert [c.request.request_id for c in prefill.scheduled] == ["b", "c"]
    assert [c.request.request_id for c in decode.scheduled] == ["a"]
    assert transfers == [("c", [7, 2, 9])]
    for part in (prefill, decode):  # both ranks forget finished requests
        assert part.finished_req_ids == ["z"]
    # copy-on-write serves decodes (a fork writing into a shared block): the decode rank's
    assert decode.block_copies == [(1, 2)] and prefill.block_copies == []


@pytest.fixture(scope="module")
def disaggregated():
    llm = LLM(dtype="float32", max_num_batched_tokens=32, kv_transfer_config=KV_TRANSFER)
    yield llm
    llm.shutdown()


def test_greedy_output_matches_a_colocated_engine(disaggregated, reference_outputs):
    disaggregated.engine.clear_parallel_stats()
    outputs = disaggregated.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs
    engine = disaggregated.engine
    records = engine.executor.kv_transfer_records()
    # one transfer per request, of the blocks its prompt fills, every layer's K and V
    assert sorted(r.request_id for r in records) == sorted(o.request_id for o in outputs)
    block_size = engine.kv_cache_manager.block_size
    block_bytes = kv_cache_block_bytes(engine.config, block_size, torch_dtype("float32"))
    lengths = {o.request_id: len(o.prompt_token_ids) for o in outputs}
    for record in records:
        assert record.num_blocks == -(-lengths[record.request_id] // block_size)
        assert record.num_bytes == record.num_blocks * block_bytes
        assert record.seconds > 0


def test_mixed_load_latencies_are_measured(disaggregated):
    disaggregated.engine.clear_parallel_stats()
    summary = run_mixed_load(disaggregated, num_decoders=2, num_long=2, long_len=40, max_tokens=5)
    assert summary.num_requests == 4
    assert summary.num_itl == 4 * (5 - 1)
    assert 0 < summary.ttft_median_s <= summary.ttft_max_s
    assert 0 < summary.itl_median_s <= summary.itl_max_s
    # the decoders' gaps are a subset of all gaps; long prompts were prefilled
    assert 0 < summary.decode_itl_median_s <= summary.decode_itl_max_s <= summary.itl_max_s
    assert summary.long_prefill_max_s > 0
    records = disaggregated.engine.executor.kv_transfer_records()
    assert len(records) == 4 and summary.kv_transfer_bytes == sum(r.num_bytes for r in records)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(kv_transfer_config="gloo"), TypeError, "must be a dict"),
        (dict(kv_transfer_config={"kv_connector": "NixlConnector"}), ValueError, "kv_connector"),
        (dict(kv_transfer_config={"kv_role": "kv_producer"}), ValueError, "kv_both"),
        (dict(kv_transfer_config={"kv_port": 1}), ValueError, "does not use"),
        (
            dict(kv_transfer_config=KV_TRANSFER, tensor_parallel_size=2),
            ValueError,
            "cannot be combined with tensor_parallel_size",
        ),
        (
            dict(kv_transfer_config=KV_TRANSFER, quantization="int8"),
            ValueError,
            "quantization cannot be combined",
        ),
    ],
)
def test_bad_kv_transfer_options(options, error, message):
    with pytest.raises(error, match=message):
        EngineArgs(device="cpu", **options)


def test_disaggregation_needs_two_ranks(monkeypatch):
    args = EngineArgs(device="cpu", kv_transfer_config=KVTransferConfig())
    assert args.enable_prefix_caching is False  # never on: a prefix may sit on the other rank
    monkeypatch.setattr("minillm.engine.args.max_world_size", lambda device_type: 1)
    with pytest.raises(ValueError, match="needs 2 processes .* at most 1"):
        EngineArgs(device="cpu", kv_transfer_config=KV_TRANSFER)


def test_routes_are_not_recorded_when_disaggregated(disaggregated):
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        disaggregated.engine.expert_load()  # the bundled model is dense
    # an MoE model's engine with kv_transfer_config refuses too, without touching the ranks
    engine = types.SimpleNamespace(
        config=dataclasses.replace(
            disaggregated.engine.config,
            architecture="Qwen3MoeForCausalLM",
            qk_norm=True,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
        ),
        executor=disaggregated.engine.executor,
    )
    with pytest.raises(ValueError, match="not recorded with kv_transfer_config"):
        LLMEngine._check_routing_recorded(engine)


def test_decode_steps_on_while_the_prefill_rank_is_stopped(disaggregated):
    """The decode rank never waits for a prefill in flight: with the prefill process stopped,
    a decoding request still gets every token, and a long prompt waits for its KV; aborted
    then, its blocks stay held until its transfer lands, and none is lost."""
    engine = disaggregated.engine
    pool = engine.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], params)
    short = engine.scheduler.requests["short"]
    while short.num_output_tokens == 0:
        engine.step()
    prefill_rank = engine.executor.processes[0]
    os.kill(prefill_rank.pid, signal.SIGSTOP)
    try:
        engine.add_request("long", list(range(3, 103)), params)
        while not short.is_finished:
            engine.step()
        assert short.num_output_tokens == 8
        while "long" not in engine.scheduler.waiting_for_remote_kvs:
            engine.step()  # its four chunks are handed to the stopped rank, one a step
        long_blocks = len(engine.kv_cache_manager.get_block_ids("long"))
        engine.abort_request("long")
        engine.step()
        assert engine.has_unfinished_requests()  # its transfer is still to land
        assert pool.get_num_free_blocks() == free_before - long_blocks
    finally:
        os.kill(prefill_rank.pid, signal.SIGCONT)
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.get_num_free_blocks() == free_before
    assert not engine.scheduler.finished_awaiting_kvs


def test_a_dead_decode_rank_stops_the_engine(disaggregated):
    processes = disaggregated.engine.executor.processes
    os.kill(processes[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="rank 1 (died|exited)"):
        disaggregated.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not any(process.is_alive() for process in processes)
