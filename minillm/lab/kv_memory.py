"""KV-cache memory: bytes per token, the memory budget, and what an allocation wastes.

Every attention layer keeps, for every token of every running sequence, the numbers that
later queries attend to. How many numbers depends on the attention variant:

    MHA  multi-head          2 * num_heads * head_dim          a key and a value per head
    GQA  grouped-query       2 * num_kv_heads * head_dim       query heads share KV heads
    MQA  multi-query         2 * head_dim                      one KV head for all queries
    MLA  multi-head latent   kv_lora_rank + qk_rope_head_dim   one latent and one RoPE key

Bytes per token = layers * values per layer * bytes per value. For MHA, GQA and MQA that is
2 * layers * kv_heads * head_dim * bytes (`ModelConfig.kv_bytes_per_token`). A sliding-window
layer keeps only the last `sliding_window` tokens, so its share of a sequence stops growing
there; hybrid models mix such local layers with full (global) ones.

The pool the cache lives in is what the accelerator's memory has left once the weights and
the activations of the largest step are in place (`vllm_kv_pool_bytes`, and SGLang's
convention in `sglang_kv_pool_bytes`). `allocation_waste` compares two ways of handing that
pool out: paged (blocks of `block_size` tokens, as needed) and contiguous (`max_model_len`
slots reserved per request up front).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.lab.catalog import get_model_config, model_names
from minillm.lab.units import dtype_bytes
from minillm.model.config import ModelConfig

ATTENTION_VARIANTS = ("MHA", "GQA", "MQA", "MLA")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one token leaves in the KV cache of a model, layer by layer."""

    name: str
    attention: str  # "MHA" | "GQA" | "MQA" | "MLA"
    num_layers: int  # attention layers, each with its own cache
    values_per_layer: int  # numbers one token caches in one layer
    sliding_window: int | None = None  # tokens a sliding-window (local) layer keeps
    num_sliding_layers: int = 0  # of num_layers, how many are local

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_VARIANTS:
            raise ValueError(
                f"attention must be one of {ATTENTION_VARIANTS}, got {self.attention!r}"
            )
        if self.num_layers < 1 or self.values_per_layer < 1:
            raise ValueError(
                f"num_layers and values_per_layer must be >= 1, got {self.num_layers}, "
                f"{self.values_per_layer}"
            )
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(
                f"num_sliding_layers must be in [0, num_layers={self.num_layers}], "
                f"got {self.num_sliding_layers}"
            )
        if (self.sliding_window is None) != (self.num_sliding_layers == 0):
            raise ValueError("give sliding_window and num_sliding_layers > 0 together, or neither")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def num_full_layers(self) -> int:
        """Layers that attend to the whole context and so cache every token."""
        return self.num_layers - self.num_sliding_layers


def gqa_layout(
    name: str,
    num_layers: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None = None,
    num_sliding_layers: int = 0,
) -> KVLayout:
    """MHA, GQA or MQA (named by the head counts): a key and a value per KV head per layer."""
    if num_kv_heads < 1 or num_attention_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_kv_heads ({num_kv_heads}) >= 1"
        )
    if num_kv_heads == num_attention_heads:
        attention = "MHA"
    elif num_kv_heads == 1:
        attention = "MQA"
    else:
        attention = "GQA"
    return KVLayout(
        name,
        attention,
        num_layers,
        2 * num_kv_heads * head_dim,
        sliding_window,
        num_sliding_layers,
    )


def mla_layout(name: str, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int) -> KVLayout:
    """Multi-head latent attention (DeepSeek-V2, 2024): one compressed latent per token and
    layer, shared by keys and values of every head, plus one small key that carries RoPE.

    The latent is projected up to each head's key and value inside attention, so the cache
    holds kv_lora_rank + qk_rope_head_dim numbers per token and layer, whatever the head count.
    """
    return KVLayout(name, "MLA", num_layers, kv_lora_rank + qk_rope_head_dim)


def layout_from_config(config: ModelConfig, name: str = "") -> KVLayout:
    """The KV layout of a Llama-family `ModelConfig` (every layer global)."""
    return gqa_layout(
        name or config.architecture,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )


# Models whose attention ModelConfig cannot describe: the config.json fields that fix their
# KV cache, copied value for value from each model's Hugging Face config.
DEEPSEEK_V3_CONFIG = {  # deepseek-ai/DeepSeek-V3
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
GEMMA3_27B_CONFIG = {  # google/gemma-3-27b-it, text_config
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "sliding_window": 1024,
    # every 6th layer is global, the other five local (sliding window)
    "sliding_window_pattern": 6,
}
MISTRAL_7B_V01_CONFIG = {  # mistralai/Mistral-7B-v0.1: a 4096-token window on every layer
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": 4096,
}


def _extra_layouts() -> dict[str, KVLayout]:
    ds = DEEPSEEK_V3_CONFIG
    gemma = GEMMA3_27B_CONFIG
    num_gemma_global = gemma["num_hidden_layers"] // gemma["sliding_window_pattern"]
    mistral = MISTRAL_7B_V01_CONFIG
    return {
        "DeepSeek V3": mla_layout(
            "DeepSeek V3", ds["num_hidden_layers"], ds["kv_lora_rank"], ds["qk_rope_head_dim"]
        ),
        "Gemma 3 27B": gqa_layout(
            "Gemma 3 27B",
            gemma["num_hidden_layers"],
            gemma["num_attention_heads"],
            gemma["num_key_value_heads"],
            gemma["head_dim"],
            sliding_window=gemma["sliding_window"],
            num_sliding_layers=gemma["num_hidden_layers"] - num_gemma_global,
        ),
        "Mistral 7B v0.1": gqa_layout(
            "Mistral 7B v0.1",
            mistral["num_hidden_layers"],
            mistral["num_attention_heads"],
            mistral["num_key_value_heads"],
            mistral["head_dim"],
            sliding_window=mistral["sliding_window"],
            num_sliding_layers=mistral["num_hidden_layers"],
        ),
    }


def kv_layout_names() -> list[str]:
    """Names `get_kv_layout` accepts: the model catalog, then the MLA and sliding-window models."""
    return [*model_names(), *_extra_layouts()]


def get_kv_layout(name: str) -> KVLayout:
    """The KV layout of a catalog model ("Llama 3.1 8B") or of "DeepSeek V3", "Gemma 3 27B",
    "Mistral 7B v0.1"."""
    extra = _extra_layouts()
    if name in extra:
        return extra[name]
    if name not in model_names():
        raise ValueError(f"unknown model {name!r}; expected one of {kv_layout_names()}")
    return layout_from_config(get_model_config(name), name)


def kv_bytes_per_token(layout: KVLayout, dtype: str = "bfloat16") -> float:
    """Bytes one token adds to the cache while the context is within every window:
    layers * values per layer * bytes per value."""
    return layout.num_layers * layout.values_per_layer * dtype_bytes(dtype)


def kv_bytes_per_sequence(layout: KVLayout, num_tokens: int, dtype: str = "bfloat16") -> float:
    """Bytes of the cache of one sequence of `num_tokens` tokens. A sliding-window layer holds
    at most `sliding_window` of them; a full layer holds them all."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    per_layer_token = layout.values_per_layer * dtype_bytes(dtype)
    cached = layout.num_full_layers * num_tokens
    if layout.sliding_window is not None:
        cached += layout.num_sliding_layers * min(num_tokens, layout.sliding_window)
    return cached * per_layer_token


def num_sequences_that_fit(
    kv_pool_bytes: float, layout: KVLayout, seq_len: int, dtype: str = "bfloat16"
) -> int:
    """How many sequences of `seq_len` tokens fit in a pool of `kv_pool_bytes`, all at once."""
    if kv_pool_bytes < 0 or seq_len < 1:
        raise ValueError(
            f"expected kv_pool_bytes >= 0 and seq_len >= 1, got {kv_pool_bytes}, {seq_len}"
        )
    return int(kv_pool_bytes // kv_bytes_per_sequence(layout, seq_len, dtype))


def vllm_kv_pool_bytes(
    total_memory_bytes: float,
    gpu_memory_utilization: float,
    weight_bytes: float,
    peak_activation_bytes: float,
    non_torch_bytes: float = 0.0,
) -> float:
    """The KV pool vLLM allocates: its share of the device's total memory, less the weights,
    the peak activations of a profiling step at the largest batch, and memory outside PyTorch's
    allocator (CUDA context, NCCL and CUDA-graph buffers).

    pool = total * gpu_memory_utilization - weights - activations - non_torch
    The fraction is of the *total* memory the CUDA driver reports for the device, not of the
    free memory, and it bounds this vLLM instance alone (two instances on one GPU: 0.45 each).
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    pool = (
        total_memory_bytes * gpu_memory_utilization
        - weight_bytes
        - peak_activation_bytes
        - non_torch_bytes
    )
    if pool <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {total_memory_bytes * gpu_memory_utilization:.4g} "
            f"bytes usable, {weight_bytes + peak_activation_bytes + non_torch_bytes:.4g} taken"
        )
    return pool


def sglang_kv_pool_bytes(
    total_memory_bytes: float, mem_fraction_static: float, weight_bytes: float
) -> float:
    """The KV pool SGLang allocates: mem_fraction_static covers the weights and the KV pool
    (the static memory); the rest of the device is left for activations and CUDA graphs.

    pool = total * mem_fraction_static - weights
    """
    if not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    pool = total_memory_bytes * mem_fraction_static - weight_bytes
    if pool <= 0:
        raise ValueError(
            f"no memory left for the KV cache: the weights ({weight_bytes:.4g} bytes) take all of "
            f"the static share ({total_memory_bytes * mem_fraction_static:.4g} bytes)"
        )
    return pool


def kv_bytes_in_flight(
    arrival_rate_per_s: float,
    prompt_len: int,
    output_len: int,
    prefill_s: float,
    tpot_s: float,
    kv_bytes_per_token: float,
) -> float:
    """The mean KV bytes held by requests in flight, by Little's law (L = lambda * W).

    Applied to byte-seconds instead of requests: each request holds its prompt's KV for the
    prefill, then output_len decode steps of tpot_s each, growing from prompt_len to
    prompt_len + output_len tokens (prompt_len + output_len / 2 on average). The mean bytes in
    use is the arrival rate times the byte-seconds one request occupies:

        lambda * b * (prompt_len * prefill_s + (prompt_len + output_len / 2) * output_len * tpot_s)
    """
    if min(arrival_rate_per_s, prompt_len, output_len, prefill_s, tpot_s) < 0:
        raise ValueError("rates, lengths and times must be >= 0")
    decode_s = output_len * tpot_s
    token_seconds = prompt_len * prefill_s + (prompt_len + output_len / 2) * decode_s
    return arrival_rate_per_s * kv_bytes_per_token * token_seconds


@dataclass(frozen=True, slots=True)
class AllocationWaste:
    """Token slots a set of sequences uses, and what two allocators set aside for them."""

    used_tokens: int  # tokens the sequences actually hold
    paged_tokens: int  # slots of whole blocks of block_size, allocated as a sequence grows
    contiguous_tokens: int  # max_model_len slots reserved per sequence when it starts

    @property
    def paged_waste_fraction(self) -> float:
        """Share of the paged allocation left empty (only the last block of each sequence)."""
        return 1 - self.used_tokens / self.paged_tokens if self.paged_tokens else 0.0

    @property
    def contiguous_waste_fraction(self) -> float:
        """Share of the contiguous reservation left empty."""
        return 1 - self.used_tokens / self.contiguous_tokens if self.contiguous_tokens else 0.0


def allocation_waste(
    seq_lens: Sequence[int], block_size: int, max_model_len: int
) -> AllocationWaste:
    """Compare paged and contiguous allocation for sequences of the given final lengths.

    Paged: ceil(len / block_size) blocks per sequence, so at most block_size - 1 empty slots
    each (internal fragmentation). Contiguous: max_model_len slots each, whatever the length.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if any(not 0 <= n <= max_model_len for n in seq_lens):
        raise ValueError(f"every length must be in [0, max_model_len={max_model_len}]")
    return AllocationWaste(
        used_tokens=sum(seq_lens),
        paged_tokens=sum(math.ceil(n / block_size) * block_size for n in seq_lens),
        contiguous_tokens=len(seq_lens) * max_model_len,
    )
