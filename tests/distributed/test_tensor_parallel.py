"""Tensor parallelism over two gloo ranks: shards against transformers' logits, the engine
against itself on one process, and the collectives it counts against the formula."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import GREEDY, PROMPTS
from dist_testing import build_hf_model, run_on_ranks, save_checkpoint, sharded_causal_logits

from minillm import LLM, SamplingParams
from minillm.distributed.parallel_layers import vocab_range
from minillm.distributed.tensor_parallel import kv_head_range
from minillm.model.loader import load_model


def random_configs(count: int, seed: int) -> list[tuple[str, dict]]:
    """Held-out shapes: KV heads per rank 2, 1 or shared (replicated), tied or untied
    embeddings, Llama biases, a vocabulary that two ranks split unevenly, Qwen3's head_dim."""
    rng = random.Random(seed)
    configs = []
    for i in range(count):
        arch = ("llama", "qwen3")[i % 2]
        heads = rng.choice([4, 8])
        config = dict(
            num_attention_heads=heads,
            num_key_value_heads=rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
            hidden_size=heads * rng.choice([8, 16]),
            intermediate_size=rng.choice([32, 48, 96]),
            vocab_size=rng.choice([97, 101, 128]),
            tie_word_embeddings=rng.random() < 0.5,
            num_hidden_layers=rng.choice([1, 2]),
        )
        if arch == "llama":
            config["attention_bias"] = rng.random() < 0.5
        else:
            config["head_dim"] = rng.choice([8, 24])
        configs.append((arch, config))
    return configs


def test_shards_give_transformers_logits_on_random_llama_and_qwen3(tmp_path):
    configs = random_configs(6, seed=18)
    # every kind of KV split occurs: more KV heads than ranks, as many, fewer (replicated)
    assert {config["num_key_value_heads"] for _, config in configs} == {1, 2, 4}
    token_ids = torch.tensor([[1, 5, 9, 33, 7, 60, 2, 14, 40, 3]])
    checkpoints, expected = [], []
    for i, (arch, config) in enumerate(configs):
        hf_model = build_hf_model(arch, seed=i, **config)
        checkpoints.append(str(save_checkpoint(hf_model, tmp_path / f"{arch}-{i}")))
        with torch.no_grad():
            expected.append(hf_model(token_ids).logits)
    for rank_logits in run_on_ranks(sharded_causal_logits, checkpoints, token_ids):
        for (arch, config), got, want in zip(configs, rank_logits, expected, strict=True):
            assert got.shape == want.shape, (arch, config)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=str((arch, config)))
            assert torch.equal(got.argmax(-1), want.argmax(-1)), (arch, config)


@pytest.mark.parametrize(
    ("num_kv_heads", "world_size", "expected"),
    [
        (4, 2, [(0, 2), (2, 4)]),
        (2, 2, [(0, 1), (1, 2)]),
        (1, 2, [(0, 1), (0, 1)]),  # fewer KV heads than ranks: replicated
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
    ],
)
def test_kv_heads_are_split_or_replicated(num_kv_heads, world_size, expected):
    assert [kv_head_range(num_kv_heads, r, world_size) for r in range(world_size)] == expected


def test_vocab_ranges_cover_the_vocabulary_once():
    for vocab_size in (1, 7, 100, 101):
        for world_size in (1, 2, 3, 4):
            ranges = [vocab_range(vocab_size, r, world_size) for r in range(world_size)]
            covered = [t for start, end in ranges for t in range(start, end)]
            assert covered == list(range(vocab_size))


@pytest.fixture(scope="module")
def tp_engine():
    llm = LLM(dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32)
    yield llm
    llm.shutdown()


def test_greedy_output_matches_one_process_on_the_bundled_model(tp_engine, reference_outputs):
    outputs = tp_engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs


def test_collectives_per_step_follow_the_formula(tp_engine):
    config = load_model("minillm-stdlib-target", "float32", weights=False).config
    layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    tp_engine.engine.clear_parallel_stats()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tp_engine.generate(PROMPTS, params, use_tqdm=False)
    records = tp_engine.engine.collective_stats()
    # prefill steps (more tokens than sampled rows) and decode steps both occur
    assert any(record.num_tokens > record.num_sampled for record in records)
    assert any(record.num_tokens == record.num_sampled for record in records)
    for record in records:
        tokens, sampled = record.num_tokens, record.num_sampled
        # two all-reduces per layer (o_proj, down_proj) plus the vocabulary-parallel embedding,
        # each of [tokens, hidden] float32
        assert record.collectives.calls["all_reduce"] == 2 * layers + 1
        assert record.collectives.bytes["all_reduce"] == (2 * layers + 1) * tokens * hidden * 4
        # the LM head: one all-gather of each rank's half of the sampled rows' logits
        if sampled:
            assert record.collectives.calls["all_gather"] == 1
            assert record.collectives.bytes["all_gather"] == sampled * (vocab // 2) * 4
        else:
            assert "all_gather" not in record.collectives.calls


def test_each_rank_caches_its_share_of_the_kv_heads(tp_engine):
    # the bundled model has 2 KV heads: one per rank
    assert tp_engine.engine.executor.call("kv_cache_heads") == [1, 1]
