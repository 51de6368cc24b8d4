"""The roofline and the FLOP and byte counts of a decoder step, against independent oracles.

Oracles: torch's FlopCounterMode on a real minillm model (GEMM FLOPs), the model's own
parameters (weight bytes), brute-force counting of causal (query, key) pairs, published
parameter counts, and hand-derived worked examples.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from minillm.lab import roofline
from minillm.lab.catalog import get_model_config, model_names
from minillm.lab.hardware import get_device
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM

H100_BF16 = 989.4e12
H100_BW = 3.35e12


@st.composite
def configs(draw):
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    arch = draw(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]))
    return ModelConfig(
        architecture=arch,
        vocab_size=draw(st.integers(8, 80)),
        hidden_size=draw(st.integers(2, 12)) * 4,
        intermediate_size=draw(st.integers(4, 64)),
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=draw(st.sampled_from([2, 4, 8])),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=arch == "Qwen2ForCausalLM" or draw(st.booleans()),
        qk_norm=arch == "Qwen3ForCausalLM",
    )


# --- the roofline itself ---------------------------------------------------------------


def test_h100_bf16_ridge_is_295_flop_per_byte():
    h100 = get_device("H100 SXM")
    ridge = roofline.ridge_point(h100.peak_flops("bf16"), h100.memory_bandwidth_bytes_per_s)
    assert ridge == pytest.approx(989.4 / 3.35)
    assert round(ridge) == 295


def test_ridge_point_rejects_nonpositive_rates():
    with pytest.raises(ValueError, match="must be > 0"):
        roofline.ridge_point(0.0, 1.0)


@given(
    intensity=st.floats(0, 1e6),
    peak=st.floats(1e9, 1e16),
    bandwidth=st.floats(1e9, 1e13),
)
def test_attainable_is_the_lower_ceiling(intensity, peak, bandwidth):
    got = roofline.attainable_flops_per_s(intensity, peak, bandwidth)
    assert got <= peak and got <= bandwidth * intensity * (1 + 1e-12)
    ridge = peak / bandwidth
    if intensity >= ridge:
        assert got == peak
        assert roofline.regime(intensity, peak, bandwidth) == "compute-bound"
    else:
        assert got == pytest.approx(bandwidth * intensity)
        assert roofline.regime(intensity, peak, bandwidth) == "memory-bound"


def test_attainable_at_the_ridge_touches_both_ceilings():
    ridge = H100_BF16 / H100_BW
    assert roofline.attainable_flops_per_s(ridge, H100_BF16, H100_BW) == pytest.approx(H100_BF16)
    assert roofline.attainable_flops_per_s(ridge / 2, H100_BF16, H100_BW) == pytest.approx(
        H100_BF16 / 2
    )


@given(m=st.integers(1, 4096), k=st.integers(1, 4096), n=st.integers(1, 4096))
def test_gemm_counts(m, k, n):
    assert roofline.gemm_flops(m, k, n) == 2 * m * k * n
    assert roofline.gemm_bytes(m, k, n, 2) == 2 * (m * k + k * n + m * n)
    assert roofline.gemm_intensity(m, k, n, 2) == pytest.approx(m * k * n / (m * k + k * n + m * n))


def test_gemm_intensity_worked_examples():
    # a decode GEMM reads a 4096 x 4096 bf16 weight for B tokens: about B FLOP/byte
    for batch in (1, 8, 64):
        got = roofline.gemm_intensity(batch, 4096, 4096, 2)
        assert got == pytest.approx(batch, rel=batch / 4096 * 2.1)
    # a square bf16 GEMM of side n has intensity n / 3
    assert roofline.gemm_intensity(3000, 3000, 3000, 2) == pytest.approx(1000)


# --- parameter and byte counts ------------------------------------------------------------


@pytest.mark.parametrize(
    "name, published",
    [
        # safetensors total_size / 2 bytes of the bf16 checkpoints on the Hugging Face Hub
        ("Llama 3.1 8B", 8_030_261_248),
        ("Llama 3.3 70B", 70_553_706_496),
        ("Qwen3-8B", 8_190_735_360),
        ("Mistral 7B", 7_248_023_552),
        ("Qwen3-0.6B", 596_049_920),  # tied embeddings: the table counted once
    ],
)
def test_num_params_matches_published_checkpoints(name, published):
    assert roofline.num_params(get_model_config(name)) == published


@settings(max_examples=15)
@given(config=configs())
def test_num_params_matches_the_model(config):
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert roofline.num_params(config) == sum(p.numel() for p in model.parameters())


@settings(max_examples=15)
@given(config=configs(), batch=st.integers(1, 4), context=st.integers(1, 40))
def test_step_reads_every_parameter_but_an_untied_embedding_table(config, batch, context):
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    read = sum(
        p.numel()
        for name, p in model.named_parameters()
        if config.tie_word_embeddings or name != "model.embed_tokens.weight"
    )
    cost = roofline.decode_step_cost(config, batch, context, dtype="bfloat16")
    assert cost.weight_bytes == 2 * read
    assert roofline.model_weight_bytes(config, "fp8_e4m3") == roofline.num_params(config)


@given(config=configs(), batch=st.integers(1, 64), context=st.integers(1, 10_000))
def test_kv_bytes_are_every_context_token_read_once(config, batch, context):
    cost = roofline.decode_step_cost(config, batch, context, dtype="bfloat16", kv_dtype="fp8_e4m3")
    assert cost.kv_bytes == batch * context * config.kv_bytes_per_token(dtype_bytes=1)
    assert roofline.kv_cache_bytes(config, batch * context, "fp8_e4m3") == cost.kv_bytes


# --- FLOPs against torch's FLOP counter and brute force ------------------------------------


def _gemm_flops_by_module(model, input_ids):
    with FlopCounterMode(display=False) as counter:
        model.forward_causal(input_ids)
    totals = {"qkv_proj": 0, "o_proj": 0, "mlp": 0, "lm_head": 0}
    for module, counts in counter.get_flop_counts().items():
        flops = sum(counts.values())
        if module.endswith(("q_proj", "k_proj", "v_proj")):
            totals["qkv_proj"] += flops
        elif module.endswith("o_proj"):
            totals["o_proj"] += flops
        elif module.endswith(("gate_proj", "up_proj", "down_proj")):
            totals["mlp"] += flops
        elif module == "Linear":  # the LM head, the only Linear outside LlamaModel
            totals["lm_head"] += flops
    return totals


@settings(max_examples=10)
@given(config=configs(), batch=st.integers(1, 3), prompt_len=st.integers(1, 6))
def test_gemm_flops_match_torch_flop_counter(config, batch, prompt_len):
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (batch, prompt_len))
    counted = _gemm_flops_by_module(model, ids)
    cost = roofline.prefill_cost(config, prompt_len, batch)
    for name in ("qkv_proj", "o_proj", "mlp"):
        assert cost.op(name).flops == counted[name], name
    # forward_causal computes logits at every position; a step only at the last one
    assert cost.op("lm_head").flops * prompt_len == counted["lm_head"]


def _causal_pairs(query_len, context_len):
    pairs = 0
    for j in range(query_len):
        position = context_len - query_len + j
        pairs += sum(1 for key in range(context_len) if key <= position)
    return pairs


@given(
    config=configs(),
    batch=st.integers(1, 5),
    query_len=st.integers(1, 20),
    cached=st.integers(0, 30),
)
def test_attention_flops_count_causal_pairs(config, batch, query_len, cached):
    context = cached + query_len
    cost = roofline.step_cost(config, batch, query_len, context)
    per_pair = 2 * 2 * config.num_attention_heads * config.head_dim  # QK^T and PV
    expected = config.num_hidden_layers * batch * _causal_pairs(query_len, context) * per_pair
    assert cost.op("attention").flops == expected


def test_llama8b_decode_flops_worked_example():
    """Batch 1, context 1: 2 FLOPs per weight used, plus one (query, key) pair per layer."""
    config = get_model_config("Llama 3.1 8B")
    h, layers, vocab = 4096, 32, 128256
    norms = layers * 2 * h + h
    matmul_weights = 8_030_261_248 - vocab * h - norms  # all but the embedding table and norms
    expected = 2 * matmul_weights + layers * 4 * 32 * 128
    assert roofline.decode_step_cost(config, 1, 1).flops == expected


def test_decode_gemms_sit_near_one_flop_per_byte_in_bf16():
    cost = roofline.decode_step_cost(get_model_config("Llama 3.1 8B"), 1, 4096)
    for name in ("qkv_proj", "o_proj", "mlp", "lm_head"):
        assert cost.op(name).intensity == pytest.approx(1.0, abs=0.01)
    # GQA: each K/V element serves num_heads / num_kv_heads = 4 queries, 2 FLOPs each per
    # element pair, over 2 bytes per element: intensity about 4
    assert cost.op("attention").intensity == pytest.approx(4.0, rel=0.01)


def test_prefill_is_far_above_the_h100_ridge_and_decode_far_below():
    config = get_model_config("Llama 3.1 8B")
    ridge = H100_BF16 / H100_BW
    assert roofline.prefill_cost(config, 2048).intensity > 4 * ridge
    assert roofline.decode_step_cost(config, 1, 2048).intensity < ridge / 100


def test_step_cost_rejects_impossible_shapes():
    config = get_model_config("Qwen3-0.6B")
    with pytest.raises(ValueError, match="query_len <= context_len"):
        roofline.step_cost(config, 1, 10, 5)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        roofline.decode_step_cost(config, 0, 5)
    with pytest.raises(KeyError, match="no op 'softmax'"):
        roofline.decode_step_cost(config, 1, 5).op("softmax")


# --- floors, the compute-bound batch, MFU and MBU ------------------------------------------


def test_bandwidth_floor_of_llama70b_fp8_on_h100():
    config = get_model_config("Llama 3.3 70B")
    h100 = get_device("H100 SXM")
    weights_read = 70_553_706_496 - 128256 * 8192  # one fp8 byte per weight but the embedding
    kv = 4096 * 2 * 80 * 8 * 128  # 4096 tokens of fp8 K and V
    floor = roofline.decode_bandwidth_floor_s(config, h100, 1, 4096, dtype="fp8_e4m3")
    assert floor == pytest.approx((weights_read + kv) / 3.35e12, rel=1e-12)
    assert 20.9e-3 < floor < 21e-3


def test_step_time_floor_is_the_larger_floor():
    config = get_model_config("Llama 3.1 8B")
    decode = roofline.decode_step_cost(config, 1, 1024)
    prefill = roofline.prefill_cost(config, 4096)
    assert roofline.step_time_floor_s(decode, H100_BF16, H100_BW) == decode.min_bytes / H100_BW
    assert roofline.step_time_floor_s(prefill, H100_BF16, H100_BW) == prefill.flops / H100_BF16


@settings(max_examples=20)
@given(
    name=st.sampled_from(model_names()),
    context=st.integers(1, 600),
    dtype=st.sampled_from(["bfloat16", "fp8_e4m3"]),
    device=st.sampled_from(["H100 SXM", "A100 SXM 80GB", "L4", "MI300X"]),
)
def test_compute_bound_batch_is_the_first_batch_past_the_ridge(name, context, dtype, device):
    config, spec = get_model_config(name), get_device(device)
    peak = spec.peak_flops("bfloat16")
    bw = spec.memory_bandwidth_bytes_per_s
    ridge = peak / bw
    batch = roofline.decode_compute_bound_batch(config, peak, bw, context, dtype)

    def intensity(b):
        return roofline.decode_step_cost(config, b, context, dtype).intensity

    if batch is None:
        assert intensity(10**7) < ridge
    else:
        assert intensity(batch) >= ridge
        assert batch == 1 or intensity(batch - 1) < ridge


def test_compute_bound_batch_worked_example():
    """Short context: b = I* W / (f - I* k) by hand for Llama 3.1 8B on an H100."""
    config = get_model_config("Llama 3.1 8B")
    weights = 2 * (8_030_261_248 - 128256 * 4096)
    flops = roofline.decode_step_cost(config, 1, 1).flops
    kv = 2 * 32 * 8 * 128 * 2
    ridge = H100_BF16 / H100_BW
    expected = math.ceil(ridge * weights / (flops - ridge * kv))
    assert roofline.decode_compute_bound_batch(config, H100_BF16, H100_BW, 1) == expected
    assert 290 < expected < 300
    # at a few thousand tokens of context the KV cache alone outweighs the ridge
    assert roofline.decode_compute_bound_batch(config, H100_BF16, H100_BW, 4096) is None


def test_mfu_and_mbu():
    assert roofline.mfu(989.4e12 * 0.5, 1.0, 989.4e12) == pytest.approx(0.5)
    assert roofline.mbu(3.35e12 * 0.02, 0.025, 3.35e12) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="time_s must be > 0"):
        roofline.mbu(1.0, 0.0, 1.0)
