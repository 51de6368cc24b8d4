"""EngineArgs: options checked where they enter, and the KV-cache pool sized from them."""

from __future__ import annotations

import pytest
import torch

from minillm.engine.args import (
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    EngineArgs,
    check_pool_fits,
    kv_cache_block_bytes,
)
from minillm.model.config import ModelConfig


def llama_config(layers: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 320,
            "hidden_size": kv_heads * head_dim * 2,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": kv_heads * 2,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": 4096,
        }
    )


def test_block_bytes_by_hand():
    # 2 (K and V) * 2 layers * 16 tokens * 4 heads * 8 dims * 2 bytes
    assert kv_cache_block_bytes(llama_config(2, 4, 8), 16, torch.float16) == 4096
    assert kv_cache_block_bytes(llama_config(2, 4, 8), 16, torch.float32) == 8192
    # Llama-3-8B: 32 layers, 8 KV heads of 128 dims; bf16 blocks of 16 tokens are 2 MiB
    assert kv_cache_block_bytes(llama_config(32, 8, 128), 16, torch.bfloat16) == 2 * 1024**2


def test_pool_from_a_memory_budget():
    config = llama_config(32, 8, 128)
    args = EngineArgs(kv_cache_memory_bytes=1024**3)
    assert args.num_blocks(config, torch.bfloat16, max_model_len=4096) == 512


def test_the_default_pool_holds_at_least_one_whole_sequence():
    config = llama_config(2, 4, 8)  # 256 bytes per token in float16
    # half of max_num_seqs sequences of max_model_len tokens ...
    args = EngineArgs(max_num_seqs=8)
    assert args.num_blocks(config, torch.float16, 1024) == 8 * 1024 // 2 // 16
    # ... but never less than one sequence (max_num_seqs=1 used to get half of one)
    assert EngineArgs(max_num_seqs=1).num_blocks(config, torch.float16, 1024) == 1024 // 16
    # and at most 1 GiB unless one sequence needs more
    big = llama_config(32, 8, 128)  # 128 KiB per token in bfloat16
    blocks = EngineArgs(max_num_seqs=256).num_blocks(big, torch.bfloat16, 4096)
    assert blocks * 16 * big.kv_bytes_per_token(2) == DEFAULT_KV_CACHE_MEMORY_BYTES


def test_a_pool_smaller_than_one_sequence_is_refused_with_the_numbers():
    config = llama_config(2, 4, 8)
    with pytest.raises(ValueError, match=r"10 blocks of 16 tokens.*at least 64 blocks"):
        EngineArgs(num_gpu_blocks=10).num_blocks(config, torch.float16, 1024)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        EngineArgs(kv_cache_memory_bytes=4096).num_blocks(config, torch.float16, 1024)


def test_an_absurd_pool_is_refused_before_allocating():
    with pytest.raises(ValueError, match="bytes free; ask for fewer blocks"):
        check_pool_fits(10**12, 2**20, torch.device("cpu"))
    check_pool_fits(4, 4096, torch.device("cpu"))  # a few KiB always fit


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be an int >= 1"),
        ({"max_num_seqs": True}, "max_num_seqs must be an int >= 1"),
        ({"block_size": 2.5}, "block_size must be an int >= 1"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "must be >= max_num_seqs"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of"),
        ({"batching_type": "dynamic"}, "batching_type must be one of"),
        ({"num_gpu_blocks": 4, "kv_cache_memory_bytes": 10}, "not both"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
        ({"prefix_caching_algo": "trie"}, "prefix_caching_algo must be one of"),
        ({"stats_window": 0}, "stats_window must be an int >= 1"),
        ({"seed": 2**64}, "seed must be an int in"),
        ({"seed": "0"}, "seed must be an int in"),
    ],
)
def test_bad_options_are_refused_at_once(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


def test_the_token_budget_defaults_cover_every_seat_and_whole_prompts_without_chunks():
    assert EngineArgs().resolve_max_num_batched_tokens(4096) == 2048
    assert EngineArgs(max_num_seqs=4096).resolve_max_num_batched_tokens(4096) == 4096
    assert EngineArgs(enable_chunked_prefill=False).resolve_max_num_batched_tokens(8192) == 8192
