"""The roofline model, and what one forward step of a decoder costs in FLOPs and bytes.

The roofline (Williams, Waterman and Patterson, 2009, "Roofline: an insightful visual
performance model for multicore architectures") bounds the speed of an operation by two
ceilings: a processor does at most P FLOP/s (its peak) and moves at most B bytes/s
between memory and the chip (its bandwidth). An operation that does F FLOPs and moves
Q bytes has arithmetic intensity I = F / Q and runs at no more than

    attainable(I) = min(P, B * I)  FLOP/s,

so it takes at least max(F / P, Q / B) seconds. The two ceilings meet at the ridge point
I* = P / B: below it an operation is memory-bound, above it compute-bound.

`step_cost` counts the FLOPs and bytes of one forward step of a Llama-family decoder
(`ModelConfig`) for `batch_size` sequences, each adding `query_len` new tokens to a
context of `context_len` tokens (the new ones included): decode is query_len=1, a whole
prefill is query_len=context_len. The count is per operation, summed over layers:

- qkv_proj, o_proj, mlp: GEMMs [T, K] x [K, N] over the T = batch_size * query_len new
  tokens, 2*T*K*N FLOPs each; the MLP is three of them (gate, up, down);
- attention: 4 * num_heads * head_dim FLOPs per (query, key) pair, QK^T and PV; a causal
  query at position p sees p + 1 keys; every context token's K and V is read once;
- lm_head: logits only for the last token of each sequence (the one that is sampled).

Weights are read once per step whatever the batch size: that is the point of batching.
RMSNorm weights and biases are counted with the projection they precede or belong to, so
the ops' weights add up to every parameter the step reads (all of them but an untied
embedding table, of which a step reads only its tokens' rows). Softmax, RoPE, norms and
activations add elementwise FLOPs that this count leaves out; they are a few percent.

Activation bytes are the GEMM inputs and outputs (plus the new K/V written to the cache),
as if every op read its input from memory and wrote its output back. The bytes a step
cannot avoid are weights + KV cache (`StepCost.min_bytes`): the bandwidth floor and MBU
use those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from minillm.lab.hardware import DeviceSpec
from minillm.lab.units import dtype_bytes
from minillm.model.config import ModelConfig

Regime = Literal["memory-bound", "compute-bound"]


def ridge_point(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """The intensity I* = P / B (FLOP/byte) where the bandwidth and compute ceilings meet."""
    if not (peak_flops_per_s > 0 and bandwidth_bytes_per_s > 0):
        raise ValueError(
            f"peak FLOP/s and bandwidth must be > 0, got {peak_flops_per_s}, "
            f"{bandwidth_bytes_per_s}"
        )
    return peak_flops_per_s / bandwidth_bytes_per_s


def attainable_flops_per_s(
    intensity: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float
) -> float:
    """The roofline: min(P, B * I) FLOP/s for an operation of intensity I FLOP/byte."""
    if intensity < 0:
        raise ValueError(f"intensity must be >= 0 FLOP/byte, got {intensity}")
    return min(peak_flops_per_s, bandwidth_bytes_per_s * intensity)


def regime(intensity: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> Regime:
    """Which ceiling binds: compute-bound when I >= P / B, memory-bound below."""
    ridge = ridge_point(peak_flops_per_s, bandwidth_bytes_per_s)
    return "compute-bound" if intensity >= ridge else "memory-bound"


def gemm_flops(m: int, k: int, n: int) -> int:
    """FLOPs of [m, k] x [k, n]: 2*m*k*n (a multiply and an add per term of each dot product)."""
    return 2 * m * k * n


def gemm_bytes(m: int, k: int, n: int, element_bytes: float) -> float:
    """Bytes of [m, k] x [k, n] when each operand is read once and the result written once:
    (m*k + k*n + m*n) * element_bytes."""
    return (m * k + k * n + m * n) * element_bytes


def gemm_intensity(m: int, k: int, n: int, element_bytes: float) -> float:
    """FLOPs per byte of [m, k] x [k, n]: 2mkn / ((mk + kn + mn) * bytes). For a weight
    [k, n] and m tokens with m << k, n this is about 2m / bytes: m FLOP/byte in bf16."""
    return gemm_flops(m, k, n) / gemm_bytes(m, k, n, element_bytes)


@dataclass(frozen=True, slots=True)
class OpCost:
    """FLOPs and bytes of one operation of a step, summed over layers."""

    name: str
    flops: float
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float

    @property
    def bytes(self) -> float:
        """Everything the op reads and writes when it runs on its own."""
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


@dataclass(frozen=True, slots=True)
class StepCost:
    """The ops of one forward step, in execution order, and their totals."""

    ops: tuple[OpCost, ...]

    def op(self, name: str) -> OpCost:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op {name!r}; ops are {[op.name for op in self.ops]}")

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    @property
    def weight_bytes(self) -> float:
        return sum(op.weight_bytes for op in self.ops)

    @property
    def kv_bytes(self) -> float:
        return sum(op.kv_bytes for op in self.ops)

    @property
    def activation_bytes(self) -> float:
        return sum(op.activation_bytes for op in self.ops)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def min_bytes(self) -> float:
        """The bytes no implementation can avoid: every weight and the KV cache, read once."""
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per unavoidable byte: where the whole step sits on the roofline."""
        return self.flops / self.min_bytes


def num_params(config: ModelConfig) -> int:
    """Every parameter of the model, an embedding table shared with the LM head counted once."""
    h, d = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d
    attention = h * (q_size + 2 * kv_size) + q_size * h
    if config.attention_bias:
        attention += q_size + 2 * kv_size
        if config.architecture != "Qwen2ForCausalLM":  # Qwen2 biases q, k, v only
            attention += h
    if config.qk_norm:
        attention += 2 * d
    per_layer = attention + 3 * h * config.intermediate_size + 2 * h  # + two RMSNorms
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * per_layer + h + embeddings


def model_weight_bytes(config: ModelConfig, dtype: str = "bfloat16") -> float:
    """Bytes of all parameters stored in `dtype`: num_params * bytes per element."""
    return num_params(config) * dtype_bytes(dtype)


def kv_cache_bytes(config: ModelConfig, num_tokens: int, kv_dtype: str = "bfloat16") -> float:
    """Bytes of K and V for `num_tokens` tokens: 2 * layers * kv_heads * head_dim * bytes each."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return num_tokens * per_token * dtype_bytes(kv_dtype)


def step_cost(
    config: ModelConfig,
    batch_size: int,
    query_len: int,
    context_len: int,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    activation_dtype: str | None = None,
) -> StepCost:
    """FLOPs and bytes of one step: `batch_size` sequences, each with `query_len` new tokens
    at the end of a `context_len`-token context (new tokens included).

    Weights are in `dtype`, the KV cache in `kv_dtype` (default: `dtype`), activations in
    `activation_dtype` (default: `dtype` for float formats, else bfloat16).
    """
    if batch_size < 1 or query_len < 1 or context_len < query_len:
        raise ValueError(
            "expected batch_size >= 1 and 1 <= query_len <= context_len, got "
            f"batch_size={batch_size}, query_len={query_len}, context_len={context_len}"
        )
    w = dtype_bytes(dtype)
    c = dtype_bytes(kv_dtype or dtype)
    float_formats = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
    a = dtype_bytes(activation_dtype or (dtype if dtype in float_formats else "bfloat16"))
    layers = config.num_hidden_layers
    h, d = config.hidden_size, config.head_dim
    inter, vocab = config.intermediate_size, config.vocab_size
    q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d
    qkv_size = q_size + 2 * kv_size
    tokens = batch_size * query_len

    qkv_params = h * qkv_size + h  # + input RMSNorm
    o_params = q_size * h
    if config.attention_bias:
        qkv_params += qkv_size
        o_params += h if config.architecture != "Qwen2ForCausalLM" else 0
    if config.qk_norm:
        qkv_params += 2 * d
    # causal: query j of the new tokens sits at position context_len - query_len + j
    pairs_per_seq = query_len * (context_len - query_len) + query_len * (query_len + 1) // 2
    lm_head_params = h * vocab + h  # + final RMSNorm

    ops = (
        OpCost(
            "qkv_proj",
            flops=layers * gemm_flops(tokens, h, qkv_size),
            weight_bytes=layers * qkv_params * w,
            kv_bytes=0.0,
            activation_bytes=layers * tokens * (h + qkv_size) * a,
        ),
        OpCost(
            "attention",
            flops=layers * batch_size * pairs_per_seq * 4 * q_size,
            weight_bytes=0.0,
            kv_bytes=layers * batch_size * context_len * 2 * kv_size * c,
            # read q, write the output; write the new tokens' K and V into the cache
            activation_bytes=layers * tokens * (2 * q_size * a + 2 * kv_size * c),
        ),
        OpCost(
            "o_proj",
            flops=layers * gemm_flops(tokens, q_size, h),
            weight_bytes=layers * o_params * w,
            kv_bytes=0.0,
            activation_bytes=layers * tokens * (q_size + h) * a,
        ),
        OpCost(
            "mlp",
            flops=layers * 3 * gemm_flops(tokens, h, inter),
            weight_bytes=layers * (3 * h * inter + h) * w,  # + post-attention RMSNorm
            kv_bytes=0.0,
            activation_bytes=layers * 3 * tokens * (h + inter) * a,
        ),
        OpCost(
            "lm_head",
            flops=gemm_flops(batch_size, h, vocab),
            weight_bytes=lm_head_params * w,
            kv_bytes=0.0,
            activation_bytes=batch_size * (h + vocab) * a,
        ),
    )
    return StepCost(ops)


def decode_step_cost(
    config: ModelConfig,
    batch_size: int,
    context_len: int,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
) -> StepCost:
    """One decode step: `batch_size` sequences add one token each to `context_len` tokens."""
    return step_cost(config, batch_size, 1, context_len, dtype, kv_dtype)


def prefill_cost(
    config: ModelConfig,
    prompt_len: int,
    batch_size: int = 1,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
) -> StepCost:
    """The prefill of `batch_size` prompts of `prompt_len` tokens each, with no cached prefix."""
    return step_cost(config, batch_size, prompt_len, prompt_len, dtype, kv_dtype)


def compute_floor_s(flops: float, peak_flops_per_s: float) -> float:
    """The shortest time to do `flops` at the peak rate: F / P seconds."""
    return flops / peak_flops_per_s


def bandwidth_floor_s(num_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """The shortest time to move `num_bytes` at full bandwidth: Q / B seconds."""
    return num_bytes / bandwidth_bytes_per_s


def step_time_floor_s(
    cost: StepCost, peak_flops_per_s: float, bandwidth_bytes_per_s: float
) -> float:
    """The roofline bound on a step: max(F / P, min_bytes / B) seconds."""
    return max(
        compute_floor_s(cost.flops, peak_flops_per_s),
        bandwidth_floor_s(cost.min_bytes, bandwidth_bytes_per_s),
    )


def decode_bandwidth_floor_s(
    config: ModelConfig,
    device: DeviceSpec,
    batch_size: int,
    context_len: int,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
) -> float:
    """The bandwidth floor of a decode step: (weight bytes + KV bytes) / bandwidth.

    Every weight the step uses and every context token's K and V are read once.
    """
    cost = decode_step_cost(config, batch_size, context_len, dtype, kv_dtype)
    return bandwidth_floor_s(cost.min_bytes, device.memory_bandwidth_bytes_per_s)


def decode_compute_bound_batch(
    config: ModelConfig,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    context_len: int,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
) -> int | None:
    """The smallest batch at which a decode step's compute floor reaches its bandwidth floor.

    With W weight bytes, and per sequence f FLOPs and k KV bytes, a batch of b does b*f
    FLOPs and moves W + b*k bytes; it is compute-bound when b*f / P >= (W + b*k) / B, i.e.
    b >= I* W / (f - I* k) with I* = P / B. When f <= I* k, every sequence brings more KV
    bytes than the ridge allows for its FLOPs, and no batch is compute-bound: None.
    """
    ridge = ridge_point(peak_flops_per_s, bandwidth_bytes_per_s)
    one = decode_step_cost(config, 1, context_len, dtype, kv_dtype)
    flops_per_seq, kv_per_seq = one.flops, one.kv_bytes
    if flops_per_seq <= ridge * kv_per_seq:
        return None

    def compute_bound(b: int) -> bool:
        cost = decode_step_cost(config, b, context_len, dtype, kv_dtype)
        return cost.intensity >= ridge

    b = max(1, math.ceil(ridge * one.weight_bytes / (flops_per_seq - ridge * kv_per_seq)))
    # the closed form is exact; these loops only absorb floating-point rounding
    while not compute_bound(b):
        b += 1
    while b > 1 and compute_bound(b - 1):
        b -= 1
    return b


def mfu(flops: float, time_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilization: achieved FLOP/s (the model's FLOPs / time) over the peak."""
    if time_s <= 0:
        raise ValueError(f"time_s must be > 0, got {time_s}")
    return flops / time_s / peak_flops_per_s


def mbu(num_bytes: float, time_s: float, bandwidth_bytes_per_s: float) -> float:
    """Model bandwidth utilization: achieved bytes/s (weights + KV / time) over the peak."""
    if time_s <= 0:
        raise ValueError(f"time_s must be > 0, got {time_s}")
    return num_bytes / time_s / bandwidth_bytes_per_s
