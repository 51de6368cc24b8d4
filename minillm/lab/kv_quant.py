"""FP8 KV cache, as a model: keys and values stored in one byte each, with a per-tensor scale.

This module measures what an FP8 cache would do to the bundled model (chapter 3) by quantizing
the cache offline, which lets it compare scales on the same cache. The engine's own FP8
cache is `LLM(kv_cache_dtype="fp8_e4m3")` (`minillm.model.kv_cache_dtype`), and the formulas
here are its own: `fp8_scale`, `quantize_fp8` and `dequantize_fp8` call that module.

float8_e4m3fn (4 exponent bits, 3 mantissa bits, no infinities) covers +-448 with about two
significant decimal digits. A value x is stored as the code q = fp8(x / scale) and read back
as q * scale. The scale maps the tensor's range onto the format's:

    scale = amax(|x|) / 448          (calibrated: the largest value lands on 448)
    scale = 1.0                      (uncalibrated: what an engine uses without scales)

With scale 1.0, values beyond 448 are clipped to 448 (saturating conversion, as in vLLM's
kernels), and values below 2**-6 lose precision in the subnormal range, down to 2**-9, below
which they become 0. Halving the bytes of the cache (bfloat16 -> fp8) doubles the tokens a
pool holds; the price is the rounding error measured here.

`decode_logits` runs a prefill and one decode step through a paged KV cache exactly as the
engine does, with a hook to quantize the cache in between, so the error of FP8 storage can be
measured on a real model's logits. `scale_kv_range` makes an equivalent model whose keys and
values are a constant times larger, to show what the range does to an uncalibrated scale.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from minillm.model.attention import AttentionMetadata
from minillm.model.kv_cache_dtype import (
    FP8_DTYPE,  # noqa: F401 (the format, re-exported for the chapters)
    FP8_E4M3_MAX,
    amax_scale,
    dequantize_kv,
    quantize_kv,
)
from minillm.model.llama import LlamaForCausalLM
from minillm.worker.model_runner import allocate_kv_caches


def fp8_scale(x: torch.Tensor) -> float:
    """Per-tensor scale amax(|x|) / 448, so the largest magnitude maps to the format's max
    (the engine's `amax_scale`); an all-zero tensor gets scale 1.0."""
    return amax_scale(x, FP8_E4M3_MAX)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to float8_e4m3fn, saturating at +-448: the engine's `quantize_kv`."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return quantize_kv(x, scale)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Codes back to values: q * scale, in `dtype` (the engine's `dequantize_kv`)."""
    return dequantize_kv(q, scale).to(dtype)


def fp8_roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What reading x back from an FP8 cache gives: dequantize(quantize(x))."""
    return dequantize_fp8(quantize_fp8(x, scale), scale, x.dtype)


def quantize_kv_caches_(
    kv_caches: list[torch.Tensor], scale: float | None = None
) -> list[tuple[float, float]]:
    """Replace every layer's keys and values by their FP8 round trip, in place.

    kv_caches: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer.
    scale None: a calibrated scale per layer for K and one for V (vLLM's per-tensor k_scale and
    v_scale); a number: that scale everywhere (1.0 is the uncalibrated default).
    Returns the (k_scale, v_scale) used for each layer.
    """
    scales = []
    for kv_cache in kv_caches:
        pair = []
        for i in (0, 1):  # keys, values
            s = fp8_scale(kv_cache[i]) if scale is None else scale
            kv_cache[i] = fp8_roundtrip(kv_cache[i], s)
            pair.append(s)
        scales.append((pair[0], pair[1]))
    return scales


def _single_sequence_metadata(
    start: int, num_tokens: int, block_table: list[int], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Metadata for one sequence adding tokens start .. start + num_tokens - 1."""
    end = start + num_tokens
    slots = [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
        block_tables=torch.tensor([block_table], dtype=torch.int32, device=device),
        max_query_len=num_tokens,
        max_seq_len=end,
        block_size=block_size,
    )


@torch.inference_mode()
def decode_logits(
    model: LlamaForCausalLM,
    token_ids: list[int],
    transform_kv: Callable[[list[torch.Tensor]], object] | None = None,
    block_size: int = 16,
) -> torch.Tensor:
    """Logits [vocab_size] of the token after `token_ids`, computed as the engine does.

    A prefill of token_ids[:-1] writes their keys and values into a fresh paged KV cache;
    `transform_kv(kv_caches)` may then change the cache in place (quantize it, say); a decode
    step of token_ids[-1] attends to the cache and gives the logits.
    """
    if len(token_ids) < 2:
        raise ValueError("need at least two tokens: a prefill and a decode step")
    weight = model.lm_head.weight
    device = weight.device
    num_blocks = math.ceil(len(token_ids) / block_size)
    kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, weight.dtype, device)
    block_table = list(range(num_blocks))
    steps = [(0, token_ids[:-1]), (len(token_ids) - 1, token_ids[-1:])]
    for step, (start, chunk) in enumerate(steps):
        if step == 1 and transform_kv is not None:
            transform_kv(kv_caches)
        meta = _single_sequence_metadata(start, len(chunk), block_table, block_size, device)
        input_ids = torch.tensor(chunk, dtype=torch.int64, device=device)
        positions = torch.arange(start, start + len(chunk), device=device)
        hidden = model(input_ids, positions, kv_caches, meta)
    return model.compute_logits(hidden[-1:])[0]


def scale_kv_range(model: LlamaForCausalLM, alpha: float) -> LlamaForCausalLM:
    """A copy of `model` that computes the same function with keys and values alpha times larger.

    Attention scores are q . k, so k * alpha with q / alpha leaves them unchanged; the output is
    o_proj(softmax(...) v), so v * alpha with o_proj / alpha leaves it unchanged. RoPE is linear
    and commutes with the scaling. (With Qwen3's q/k norm the norms' weights are scaled instead,
    since a norm undoes any scaling of its input.) Only the cached K and V change range, which
    is what an FP8 scale has to cover.
    """
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        for layer in scaled.model.layers:
            attn = layer.self_attn
            if attn.qk_norm:
                attn.k_norm.weight.mul_(alpha)
                attn.q_norm.weight.div_(alpha)
            else:
                _scale_linear_(attn.k_proj, alpha)
                _scale_linear_(attn.q_proj, 1 / alpha)
            _scale_linear_(attn.v_proj, alpha)
            attn.o_proj.weight.div_(alpha)
    return scaled


def _scale_linear_(linear: torch.nn.Linear, factor: float) -> None:
    linear.weight.mul_(factor)
    if linear.bias is not None:
        linear.bias.mul_(factor)
