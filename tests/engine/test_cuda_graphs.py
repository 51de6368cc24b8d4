"""CUDA graphs for decode steps: buckets, the choice to capture, and (on a GPU) replays that
give the eager pass's results."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import build_tiny_llama

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.model.loader import load_model
from minillm.sampling_params import SamplingParams
from minillm.worker.cuda_graphs import CUDAGraphConfig, CUDAGraphRunner, graph_batch_sizes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_on_the_cpu_the_engine_runs_eagerly_with_the_torch_backend(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, device="cpu", max_model_len=64))
    assert engine.model_runner.model.attention_backend == "torch"
    assert engine.model_runner.cuda_graph_runner is None


def test_graphs_need_cuda_and_a_capturable_backend(model_dir):
    model = load_model(model_dir).model
    kv_caches = [torch.zeros(2, 4, 16, 2, 8)]
    with pytest.raises(ValueError, match="need the KV caches on a cuda device"):
        CUDAGraphRunner(model, kv_caches, 16, CUDAGraphConfig(4, 64))


def greedy(model_dir, enforce_eager: bool, prompts):
    engine = LLMEngine(
        EngineArgs(model=model_dir, device="cuda", enforce_eager=enforce_eager, max_model_len=128)
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    return [outputs[str(i)] for i in range(len(prompts))], engine


@pytest.mark.gpu
def test_graph_replays_give_the_eager_outputs(model_dir):
    # 3 sequences: a bucket of 4 with one padded row
    prompts = [list(range(2, 9)), [5], list(range(100, 133))]
    eager, eager_engine = greedy(model_dir, True, prompts)
    graphed, graph_engine = greedy(model_dir, False, prompts)
    assert eager_engine.model_runner.cuda_graph_runner is None
    assert graph_engine.model_runner.cuda_graph_runner is not None
    assert graphed == eager


@pytest.mark.gpu
def test_a_replay_equals_the_eager_forward_and_skips_padding(model_dir):
    from minillm.model.attention import AttentionMetadata

    model = load_model(model_dir, device="cuda", attention_backend="triton").model
    kv_caches = [torch.randn(2, 16, 8, 2, 8, device="cuda") for _ in range(2)]
    runner = CUDAGraphRunner(model, kv_caches, 8, CUDAGraphConfig(4, 64))
    untouched = [cache.clone() for cache in kv_caches]
    # 3 decode tokens at positions 9, 0, 20 (a bucket of 4: one padded row)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([17, 24, 44], device="cuda"),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([10, 1, 21], dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor([[0, 2, 0], [3, 0, 0], [4, 1, 5]], device="cuda").int(),
        max_query_len=1,
        max_seq_len=21,
        block_size=8,
    )
    ids = torch.tensor([3, 4, 5], device="cuda")
    positions = torch.tensor([9, 0, 20], device="cuda")
    with torch.inference_mode():
        graphed = runner.run(ids, positions, meta).clone()
        after_graph = [cache.clone() for cache in kv_caches]
        for cache, original in zip(kv_caches, untouched, strict=True):
            cache.copy_(original)
        eager = model(ids, positions, kv_caches, meta)
    torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
    # the same cache writes: the padded row wrote nothing
    for graph_cache, eager_cache in zip(after_graph, kv_caches, strict=True):
        assert torch.equal(graph_cache, eager_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 2, 3, 5, 8])
def test_replays_of_every_bucket_give_the_eager_outputs(model_dir, num_prompts):
    # 1, 2, 3 (bucket 4), 5 (bucket 8) and 8 sequences: a different graph each, and as
    # requests finish at different lengths the batch moves down through smaller buckets
    prompts = [list(range(3 + i, 10 + 3 * i)) for i in range(num_prompts)]
    eager, _ = greedy(model_dir, True, prompts)
    graphed, engine = greedy(model_dir, False, prompts)
    assert graphed == eager
    assert len(engine.model_runner.cuda_graph_runner.graphs) >= 4


@pytest.mark.gpu
def test_the_graphs_memory_is_set_aside_before_the_kv_cache_is_sized(model_dir):
    from minillm.worker.cuda_graphs import profile_graph_bytes

    args = dict(model=model_dir, device="cuda", max_model_len=128, max_num_seqs=64)

    def pool_blocks(**extra) -> tuple[int, int, int]:
        engine = LLMEngine(EngineArgs(**args, **extra))
        model = engine.model_runner.model
        blocks = engine.kv_cache_manager.block_pool.num_blocks
        block_bytes = 16 * model.config.kv_bytes_per_token(model.lm_head.weight.element_size())
        graph_bytes = profile_graph_bytes(model, 16, CUDAGraphConfig(64, 128)) if extra else 0
        del engine, model
        torch.cuda.empty_cache()
        return blocks, block_bytes, graph_bytes

    eager_blocks, block_bytes, graph_bytes = pool_blocks(enforce_eager=True)
    graphed_blocks, _, _ = pool_blocks()
    assert graph_bytes > 0
    # one engine at a time, so each profiles the same free memory: the graphed pool is
    # smaller by the graphs' bytes, to within a block and the allocator's rounding
    fewer_bytes = (eager_blocks - graphed_blocks) * block_bytes
    assert graph_bytes * 0.8 <= fewer_bytes <= graph_bytes * 1.25 + block_bytes
