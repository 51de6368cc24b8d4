"""The FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`): storage against an E4M3 oracle built from
the format's bit layout, pool sizing, option checks, greedy agreement against a cache-free
PyTorch decoder, and prefix caching and preemption under FP8."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.kv_fp8_agreement import (
    common_prefix_len,
    compare_greedy,
    heldout_prompts,
    kv_fp8_greedy_agreement,
)
from minillm.model.attention import AttentionMetadata, torch_paged_attention, write_kv_cache
from minillm.model.kv_cache_dtype import (
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    dequantize_kv,
    quantize_kv,
)
from minillm.model.loader import load_model
from minillm.model.rope import apply_rope
from minillm.sampling_params import SamplingParams

MODEL = "minillm-stdlib-target"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def e4m3_values() -> torch.Tensor:
    """Every finite float8 E4M3 (fn) value from the bit layout, ascending: sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent field 0 is subnormal (m/8 * 2^-6); the all-ones pattern
    S.1111.111 is NaN and there are no infinities, so the largest value is 1.75 * 2^8 = 448."""
    values = set()
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # NaN
            if exponent == 0:
                magnitude = mantissa / 8 * 2.0**-6
            else:
                magnitude = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            values.update((magnitude, -magnitude))
    return torch.tensor(sorted(values), dtype=torch.float64)


E4M3 = e4m3_values()


def oracle_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value, ties to the even code (an even mantissa), saturating at
    +-448: the value a cache entry holds, in float64."""
    x = x.double().clamp(-448.0, 448.0)
    hi = torch.searchsorted(E4M3, x).clamp(1, len(E4M3) - 1)
    lo = hi - 1
    below, above = E4M3[lo], E4M3[hi]
    pick_above = (above - x) < (x - below)
    tie = (above - x) == (x - below)
    # the even code of two neighbours: the one whose mantissa's last bit is 0
    pick_above = pick_above | (tie & EVEN[hi])
    out = torch.where(pick_above, above, below)
    return torch.where(x == 0, torch.zeros_like(x), out)


def _mantissa_is_even(value: float) -> bool:
    magnitude = abs(value)
    if magnitude < 2.0**-6:
        return round(magnitude / 2.0**-9) % 2 == 0
    exponent = math.floor(math.log2(magnitude))
    return round((magnitude / 2.0**exponent - 1) * 8) % 2 == 0


EVEN = torch.tensor([_mantissa_is_even(v) for v in E4M3.tolist()])


def test_the_oracle_table_is_the_format():
    assert len(E4M3) == 253  # 254 finite codes, +0 and -0 one value
    assert float(E4M3.max()) == 448.0 == torch.finfo(torch.float8_e4m3fn).max
    assert float(E4M3[E4M3 > 0].min()) == 2.0**-9


@given(
    values=st.lists(st.floats(-2000, 2000, allow_nan=False, width=32), min_size=1, max_size=40),
    scale=st.sampled_from([1.0, 0.01, 0.37, 4.0]),
)
def test_quantize_matches_the_e4m3_oracle(values, scale):
    x = torch.tensor(values, dtype=torch.float32)
    expected = oracle_e4m3(x.double() / scale)
    got = quantize_kv(x, scale).double()
    # the division by the scale is float32 in the engine: compare codes of the same quotient
    expected_same_quotient = oracle_e4m3((x / scale).double())
    assert torch.equal(got, expected_same_quotient)
    # and the float32 quotient changes at most a rounding tie: one code apart
    assert (got - expected).abs().le((expected.abs() * 2**-3).clamp_min(2**-9)).all()
    # read back: code times scale (one float32 rounding of the product)
    torch.testing.assert_close(
        dequantize_kv(quantize_kv(x, scale), scale).double(), got * scale, rtol=2**-23, atol=0
    )


def paged_meta(seq_lens: list[int], q_lens: list[int], block_size: int, tables):
    slots, starts = [], [0]
    for seq_len, q_len, table in zip(seq_lens, q_lens, tables, strict=True):
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(seq_len - q_len, seq_len)
        ]
        starts.append(starts[-1] + q_len)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


def test_written_values_read_back_as_the_oracle_and_attention_uses_them():
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    seq_lens, tables = [7, 5], [[3, 0], [1, 4]]
    num_tokens = sum(seq_lens)
    k = torch.randn(num_tokens, kv_heads, dim) * 30  # some beyond 448 / k_scale: clipped
    v = torch.randn(num_tokens, kv_heads, dim)
    k_scale, v_scale = 0.05, 0.01
    meta = paged_meta(seq_lens, seq_lens, block_size, tables)
    cache = torch.zeros(2, 6, block_size, kv_heads, dim, dtype=torch.float8_e4m3fn)
    write_kv_cache(k, v, cache, meta.slot_mapping, k_scale, v_scale)
    rows = cache.view(2, -1, kv_heads, dim)[:, meta.slot_mapping]
    assert torch.equal(rows[0].double(), oracle_e4m3((k / k_scale).double()))
    assert torch.equal(rows[1].double(), oracle_e4m3((v / v_scale).double()))
    assert float(rows[0].float().abs().max()) == 448.0  # saturated, not NaN
    # attention over the FP8 cache = attention over a float cache of the dequantized values
    float_cache = torch.zeros(2, 6, block_size, kv_heads, dim)
    k_read = (oracle_e4m3((k / k_scale).double()) * k_scale).float()
    v_read = (oracle_e4m3((v / v_scale).double()) * v_scale).float()
    write_kv_cache(k_read, v_read, float_cache, meta.slot_mapping)
    q = torch.randn(num_tokens, heads, dim)
    for q_lens in ([7, 5], [1, 1]):  # prefill, then a decode step of each
        m = paged_meta(seq_lens, q_lens, block_size, tables)
        rows_q = torch.cat([q[: q_lens[0]], q[7 : 7 + q_lens[1]]])
        got = torch_paged_attention(rows_q, cache, m, 0.3, k_scale, v_scale)
        want = torch_paged_attention(rows_q, float_cache, m, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def kv_bytes_per_token(config, itemsize):
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def test_the_pool_holds_twice_the_blocks_of_bfloat16():
    budget = 3 << 20
    engines = {
        name: LLMEngine(
            EngineArgs(MODEL, dtype="bfloat16", kv_cache_dtype=name, kv_cache_memory_bytes=budget)
        )
        for name in ("auto", "fp8_e4m3")
    }
    config = engines["auto"].config
    blocks = {n: e.kv_cache_manager.block_pool.num_blocks for n, e in engines.items()}
    assert blocks["auto"] == budget // (16 * kv_bytes_per_token(config, 2))
    assert blocks["fp8_e4m3"] == budget // (16 * kv_bytes_per_token(config, 1))
    assert blocks["fp8_e4m3"] == 2 * blocks["auto"]
    caches = engines["fp8_e4m3"].model_runner.kv_caches
    assert {c.dtype for c in caches} == {torch.float8_e4m3fn}
    assert sum(c.numel() * c.element_size() for c in caches) <= budget


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kv_cache_dtype="fp16"), "kv_cache_dtype must be one of"),
        (dict(kv_cache_dtype="fp8_e5m2"), "E5M2"),
        (dict(kv_cache_dtype=8), "kv_cache_dtype must be one of"),
        (dict(calculate_kv_scales=True), "calculate_kv_scales applies only"),
        (dict(kv_cache_dtype="fp8", calculate_kv_scales=1), "calculate_kv_scales must be"),
        (dict(kv_cache_dtype="fp8_e4m3", attention_backend="triton"), "torch attention backend"),
    ],
)
def test_bad_kv_cache_options_are_rejected_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(MODEL, **kwargs)


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, "bfloat16", torch.device("cpu"), "torch").model


def oracle_forward(model, token_ids: list[int], fp8: bool, record=None) -> torch.Tensor:
    """Logits of the last token from a cache-free causal forward, written here: with fp8, every
    key and value is replaced by its E4M3 oracle round trip at scale 1.0 before attention (in
    the engine every attended key and value is read back from the FP8 cache)."""
    inner = model.model
    ids = torch.tensor(token_ids)
    x = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(torch.arange(len(ids)), x.dtype)
    for layer in inner.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(len(ids), attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(len(ids), attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(len(ids), attn.num_kv_heads, attn.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if record is not None:
            record.append((k, v))
        k, v = k.float(), v.float()
        if fp8:
            k, v = oracle_e4m3(k).float(), oracle_e4m3(v).float()
        group = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * attn.scale
        causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).to(x.dtype)
        x = x + attn.o_proj(out.flatten(1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.compute_logits(inner.norm(x)[-1:])[0]


@torch.inference_mode()
def oracle_greedy(model, prompt: list[int], max_tokens: int, fp8: bool) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(oracle_forward(model, tokens, fp8).argmax()))
    return tokens[len(prompt) :]


def test_agreement_is_its_definition():
    result = compare_greedy([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]], 4)
    assert result.common_prefix == [2, 4]
    assert result.agreement == (2 + 4) / 8
    assert result.token_agreement == 7 / 8
    assert common_prefix_len([1], [2]) == 0


def test_greedy_agreement_against_a_cache_free_oracle(model):
    prompts = heldout_prompts(MODEL, num_prompts=3, prompt_len=24)
    max_tokens = 10
    result = kv_fp8_greedy_agreement(MODEL, prompts, max_tokens, dtype="bfloat16")
    # the same measure from a decoder that shares no cache code with the engine
    oracle = compare_greedy(
        [oracle_greedy(model, p, max_tokens, fp8=False) for p in prompts],
        [oracle_greedy(model, p, max_tokens, fp8=True) for p in prompts],
        max_tokens,
    )
    # both within one prompt's divergence of each other (bfloat16 rounding of the two
    # implementations may move a near-tie), and the engine's fp8 tokens are the oracle's
    # wherever the float outputs agree
    assert abs(result.agreement - oracle.agreement) <= 1 / len(prompts)
    assert 0.0 <= result.agreement <= 1.0
    matches = [
        common_prefix_len(c, o) for c, o in zip(result.candidate, oracle.candidate, strict=True)
    ]
    assert sum(matches) >= 0.5 * len(prompts) * max_tokens


def test_calibrated_scales_come_from_the_first_forward(model):
    prompt = heldout_prompts(MODEL, num_prompts=1, prompt_len=20)[0]
    engine = LLMEngine(
        EngineArgs(MODEL, dtype="bfloat16", kv_cache_dtype="fp8", calculate_kv_scales=True)
    )
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    record: list = []
    with torch.inference_mode():
        oracle_forward(model, prompt, fp8=False, record=record)
    layers = engine.model_runner.model.model.layers
    for number, (layer, (k, v)) in enumerate(zip(layers, record, strict=True)):
        backend = layer.self_attn.backend
        # the first layer's keys and values are the same numbers in both; deeper down, the
        # engine's and the oracle's bfloat16 sums round in other orders, and a largest value
        # can move by a few bfloat16 steps (0.4% each)
        rel = 1e-3 if number == 0 else 3e-2
        assert backend.k_scale == pytest.approx(float(k.abs().max()) / K_SCALE_CONSTANT, rel=rel)
        assert backend.v_scale == pytest.approx(float(v.abs().max()) / V_SCALE_CONSTANT, rel=rel)
        assert not backend.calculate_kv_scales  # fixed from then on


def run(engine: LLMEngine, prompts) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def test_prefix_caching_and_preemption_keep_the_outputs_under_fp8():
    base = heldout_prompts(MODEL, num_prompts=4, prompt_len=20)
    # two pairs of prompts sharing their first 12 tokens: prefix-cache hits
    prompts = [base[0], base[0][:12] + base[1][12:], base[2], base[2][:12] + base[3][12:]]
    common = dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3", block_size=4, max_model_len=64)
    plain = run(LLMEngine(EngineArgs(MODEL, enable_prefix_caching=False, **common)), prompts)
    cached_engine = LLMEngine(EngineArgs(MODEL, **common))
    cached = run(cached_engine, prompts[:1])
    cached |= {str(int(k) + 1): t for k, t in run(cached_engine, prompts[1:]).items()}
    assert cached_engine.stats.prefix_cache_hits >= 12
    assert cached == plain
    # 16 blocks of 4 tokens: three 20-token prompts fit, not the 32 tokens each grows to
    tight = LLMEngine(EngineArgs(MODEL, num_gpu_blocks=16, enable_prefix_caching=False, **common))
    assert run(tight, prompts) == plain
    assert tight.stats.num_preemptions > 0
