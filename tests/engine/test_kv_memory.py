"""KV bytes per token, pool sizing and allocation waste, against values derived by hand."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab import kv_memory
from minillm.lab.catalog import get_model_config, model_names
from minillm.lab.units import GB, GiB, KiB


def test_llama_3_1_8b_is_128_kib_per_token_in_bf16():
    # 2 (K and V) * 32 layers * 8 KV heads * 128 dims * 2 bytes
    layout = kv_memory.get_kv_layout("Llama 3.1 8B")
    assert layout.attention == "GQA"
    assert kv_memory.kv_bytes_per_token(layout, "bfloat16") == 128 * KiB == 131_072


def test_llama_3_3_70b_is_320_kib_per_token_in_bf16():
    # 2 * 80 layers * 8 KV heads * 128 dims * 2 bytes
    layout = kv_memory.get_kv_layout("Llama 3.3 70B")
    assert kv_memory.kv_bytes_per_token(layout, "bfloat16") == 320 * KiB == 327_680


def test_deepseek_v3_mla_latent_is_70272_bytes_per_token():
    # (512 latent + 64 RoPE key) * 2 bytes * 61 layers
    layout = kv_memory.get_kv_layout("DeepSeek V3")
    assert layout.attention == "MLA"
    assert layout.values_per_layer == 576
    assert kv_memory.kv_bytes_per_token(layout, "bfloat16") == (512 + 64) * 2 * 61 == 70_272


def test_qwen3_and_mistral_bytes_per_token():
    assert (
        kv_memory.kv_bytes_per_token(kv_memory.get_kv_layout("Qwen3-0.6B")) == 2 * 28 * 8 * 128 * 2
    )
    assert kv_memory.kv_bytes_per_token(kv_memory.get_kv_layout("Qwen3-8B")) == 2 * 36 * 8 * 128 * 2
    assert kv_memory.kv_bytes_per_token(kv_memory.get_kv_layout("Mistral 7B")) == 128 * KiB


@pytest.mark.parametrize("name", model_names())
@pytest.mark.parametrize("dtype, nbytes", [("bfloat16", 2), ("float32", 4), ("fp8_e4m3", 1)])
def test_agrees_with_model_config(name, dtype, nbytes):
    layout = kv_memory.get_kv_layout(name)
    expected = get_model_config(name).kv_bytes_per_token(nbytes)
    assert kv_memory.kv_bytes_per_token(layout, dtype) == expected


def test_variant_is_named_by_head_counts():
    assert kv_memory.gqa_layout("a", 2, 8, 8, 64).attention == "MHA"
    assert kv_memory.gqa_layout("b", 2, 8, 2, 64).attention == "GQA"
    assert kv_memory.gqa_layout("c", 2, 8, 1, 64).attention == "MQA"
    # GQA divides the cache by the group size: 64 query heads over 8 KV heads is 8x
    mha = kv_memory.gqa_layout("mha", 80, 64, 64, 128)
    gqa = kv_memory.get_kv_layout("Llama 3.3 70B")
    assert kv_memory.kv_bytes_per_token(mha) == 8 * kv_memory.kv_bytes_per_token(gqa)
    with pytest.raises(ValueError):
        kv_memory.gqa_layout("bad", 2, 8, 3, 64)


def test_sliding_window_caps_local_layers():
    mistral = kv_memory.get_kv_layout("Mistral 7B v0.1")  # every layer local, window 4096
    per_token = kv_memory.kv_bytes_per_token(mistral)
    assert kv_memory.kv_bytes_per_sequence(mistral, 1000) == 1000 * per_token
    assert kv_memory.kv_bytes_per_sequence(mistral, 32768) == 4096 * per_token

    gemma = kv_memory.get_kv_layout("Gemma 3 27B")  # 62 layers: 10 global, 52 local (1024)
    assert (gemma.num_full_layers, gemma.num_sliding_layers) == (10, 52)
    per_layer_token = 2 * 16 * 128 * 2
    n = 32768
    assert kv_memory.kv_bytes_per_sequence(gemma, n) == (10 * n + 52 * 1024) * per_layer_token
    assert kv_memory.kv_bytes_per_sequence(gemma, 512) == 62 * 512 * per_layer_token


@given(st.sampled_from(kv_memory.kv_layout_names()), st.integers(0, 200_000))
def test_sequence_bytes_never_exceed_full_attention(name, n):
    layout = kv_memory.get_kv_layout(name)
    full = n * kv_memory.kv_bytes_per_token(layout)
    assert kv_memory.kv_bytes_per_sequence(layout, n) <= full
    if layout.sliding_window is None or n <= layout.sliding_window:
        assert kv_memory.kv_bytes_per_sequence(layout, n) == full


def test_sequences_that_fit():
    llama = kv_memory.get_kv_layout("Llama 3.1 8B")
    # 8 GiB hold 65,536 tokens of 128 KiB: 16 sequences of 4,096 tokens
    assert kv_memory.num_sequences_that_fit(8 * GiB, llama, 4096) == 16
    assert kv_memory.num_sequences_that_fit(8 * GiB - 1, llama, 4096) == 15
    assert kv_memory.num_sequences_that_fit(8 * GiB, llama, 4096, "fp8_e4m3") == 32


def test_vllm_pool_is_a_fraction_of_total_memory():
    # 80 GB device, 0.9: 72 GB usable; 16 GB weights, 2 GB activations, 1 GB other -> 53 GB
    pool = kv_memory.vllm_kv_pool_bytes(80 * GB, 0.9, 16 * GB, 2 * GB, 1 * GB)
    assert math.isclose(pool, 53 * GB)
    with pytest.raises(ValueError, match="no memory left"):
        kv_memory.vllm_kv_pool_bytes(24 * GB, 0.5, 16 * GB, 0)
    with pytest.raises(ValueError):
        kv_memory.vllm_kv_pool_bytes(24 * GB, 1.2, 1 * GB, 0)


def test_sglang_pool_leaves_activations_outside_the_fraction():
    pool = kv_memory.sglang_kv_pool_bytes(80 * GB, 0.88, 16 * GB)
    assert math.isclose(pool, (0.88 * 80 - 16) * GB)
    with pytest.raises(ValueError):
        kv_memory.sglang_kv_pool_bytes(80 * GB, 0.1, 16 * GB)


def test_kv_bytes_in_flight_is_rate_times_byte_seconds():
    # one request per second; 1000-token prompt held 0.5 s, then 100 tokens at 20 ms
    got = kv_memory.kv_bytes_in_flight(1.0, 1000, 100, 0.5, 0.02, 10.0)
    expected = 10.0 * (1000 * 0.5 + 1050 * 100 * 0.02)
    assert math.isclose(got, expected)
    # twice the rate, twice the bytes
    assert math.isclose(kv_memory.kv_bytes_in_flight(2.0, 1000, 100, 0.5, 0.02, 10.0), 2 * got)


def test_allocation_waste():
    waste = kv_memory.allocation_waste([1, 16, 17, 40], block_size=16, max_model_len=64)
    assert waste.used_tokens == 74
    assert waste.paged_tokens == 16 + 16 + 32 + 48
    assert waste.contiguous_tokens == 4 * 64
    assert math.isclose(waste.paged_waste_fraction, 1 - 74 / 112)
    assert math.isclose(waste.contiguous_waste_fraction, 1 - 74 / 256)


@given(st.lists(st.integers(0, 512), max_size=40), st.sampled_from([1, 8, 16, 32]))
def test_paged_waste_is_under_one_block_per_sequence(seq_lens, block_size):
    waste = kv_memory.allocation_waste(seq_lens, block_size, 512)
    assert waste.used_tokens <= waste.paged_tokens <= waste.contiguous_tokens
    assert waste.paged_tokens - waste.used_tokens <= len(seq_lens) * (block_size - 1)
    if block_size == 1:
        assert waste.paged_tokens == waste.used_tokens


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="DeepSeek V3"):
        kv_memory.get_kv_layout("GPT-5")
