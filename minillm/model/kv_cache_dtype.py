"""The KV cache's storage dtype (`kv_cache_dtype`, vLLM's option) and FP8 E4M3 storage.

`kv_cache_dtype="auto"` keeps keys and values in the model's dtype. `"fp8_e4m3"` (or vLLM's
alias `"fp8"`) stores them as `torch.float8_e4m3fn`, one byte per element, so a memory budget
holds twice the blocks of a bfloat16 cache. Each layer has one scale for its keys and one for
its values (per tensor; vLLM's `k_scale` and `v_scale`): a key k is stored as the code

    q = fp8(clamp(k / k_scale, -448, 448))

and read back, inside attention, as q * k_scale (values likewise with v_scale). 448 is E4M3's
largest finite value; clamping first makes the conversion saturate, as vLLM's kernels do,
instead of turning a large value into NaN.

How the scales are set (vLLM's two choices):

- by default both are 1.0 (vLLM's default when a checkpoint carries no scales): the codes are
  the values themselves, and anything beyond +-448 is clipped;
- with `calculate_kv_scales=True`, each layer calibrates its scales once, on the first forward
  the engine runs (the first prompt's prefill): k_scale = amax|k| / 200 and v_scale = amax|v| /
  100, vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT, which leave headroom above the first
  batch's largest value (about 2.2x for keys, 4.5x for values) before clipping. The scales
  then stay fixed for the engine's life, so every later request is stored the same way.

The engine's path is the torch attention backend (`minillm.model.attention`); the Triton
backend's kernels read the cache in the model's dtype only, and the engine refuses the
combination where the options are given.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# vLLM's calibration constants (envs K_SCALE_CONSTANT, V_SCALE_CONSTANT): scale = amax / constant
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

# option value -> storage dtype; None: the model's dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": FP8_DTYPE,  # vLLM's alias of fp8_e4m3
    "fp8_e4m3": FP8_DTYPE,
}


def check_kv_cache_dtype(kv_cache_dtype: object) -> None:
    """ValueError unless `kv_cache_dtype` is one of KV_CACHE_DTYPES' names."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        hint = ""
        if kv_cache_dtype == "fp8_e5m2":
            hint = " (E5M2 storage is not implemented; fp8_e4m3 is)"
        raise ValueError(
            f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}{hint}"
        )


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV-cache tensors are allocated in."""
    check_kv_cache_dtype(kv_cache_dtype)
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    return model_dtype if dtype is None else dtype


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Codes of x in float8_e4m3fn: x / scale, clamped to +-448, rounded to nearest even."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize_kv(codes: torch.Tensor, scale: float) -> torch.Tensor:
    """Values of FP8 codes, in float32: codes * scale."""
    return codes.float() * scale


def read_kv(cached: torch.Tensor, scale: float) -> torch.Tensor:
    """Gathered cache entries as float32 values: dequantized when the cache is FP8."""
    if is_fp8(cached):
        return dequantize_kv(cached, scale)
    return cached if cached.dtype == torch.float32 else cached.float()


def amax_scale(x: torch.Tensor, constant: float = FP8_E4M3_MAX) -> float:
    """Per-tensor scale amax(|x|) / constant: the largest magnitude is stored as `constant`
    (448, the default, uses the format's whole range). A tensor of zeros (or none) gets scale
    1.0, which stores zeros exactly."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    if not torch.isfinite(torch.tensor(amax)):
        raise ValueError("cannot scale a tensor that holds inf or nan")
    return amax / constant if amax > 0 else 1.0


def calibrated_scales(k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """(k_scale, v_scale) from one forward's keys and values, vLLM's calculate_kv_scales rule;
    a tensor of zeros (or none) gets scale 1.0."""
    return amax_scale(k, K_SCALE_CONSTANT), amax_scale(v, V_SCALE_CONSTANT)
