"""KV offload versus recompute, as a model: when fetching a prefix's KV beats computing it
again. The engine recomputes preempted requests; this module prices the alternative.

A request's KV that is not on the accelerator (it was preempted, or its prefix was evicted to
host memory) can come back two ways. Fetch it over the host link: num_tokens * bytes per token
divided by the link's bandwidth. Or recompute it: a prefill of num_tokens tokens, its FLOPs
(`roofline.prefill_cost`) divided by the FLOP rate the accelerator sustains (peak * MFU).

    fetch_s     = n * b / B
    recompute_s = F(n) / (P * mfu)

Fetching wins when B > n * b * P * mfu / F(n), the break-even bandwidth. F(n) grows a little
faster than n (attention is quadratic), so the break-even falls as prefixes grow: long
prefixes are the ones worth keeping.
"""

from __future__ import annotations

import time

import torch

from minillm.lab import roofline
from minillm.lab.units import MiB
from minillm.model.config import ModelConfig

# PCIe signalling rate per lane in GT/s, by generation; generations 3 to 5 encode 128 bits of
# data in 130 bits on the wire.
PCIE_GT_PER_S = {3: 8.0, 4: 16.0, 5: 32.0}


def pcie_bandwidth_bytes_per_s(generation: int, lanes: int = 16) -> float:
    """The raw data rate of a PCIe link in one direction: GT/s * lanes * 128/130 / 8 bits.

    Packet headers and flow control take a further 10-20%, so copies measure less (about
    25 GB/s on Gen4 x16, 50 GB/s on Gen5 x16, with pinned host memory).
    """
    if generation not in PCIE_GT_PER_S:
        raise ValueError(
            f"PCIe generation must be one of {sorted(PCIE_GT_PER_S)}, got {generation}"
        )
    if lanes not in (1, 2, 4, 8, 16):
        raise ValueError(f"lanes must be 1, 2, 4, 8 or 16, got {lanes}")
    return PCIE_GT_PER_S[generation] * 1e9 * lanes * (128 / 130) / 8


# the share of the raw rate a pinned host-to-device copy sustains once packet headers, flow
# control and DMA setup are paid: about 25 GB/s on Gen4 x16 and 50 GB/s on Gen5 x16, what
# CUDA's bandwidthTest reports on such links
PCIE_COPY_EFFICIENCY = 0.8


def pcie_copy_bandwidth_bytes_per_s(generation: int, lanes: int = 16) -> float:
    """What a copy of pinned host memory achieves over a PCIe link, one direction: the raw
    rate times PCIE_COPY_EFFICIENCY. Use this, not the raw rate, to price an offload."""
    return pcie_bandwidth_bytes_per_s(generation, lanes) * PCIE_COPY_EFFICIENCY


def swap_time_s(num_tokens: int, kv_bytes_per_token: float, bandwidth_bytes_per_s: float) -> float:
    """Seconds a preemption by swapping costs in transfers: the KV copied out to the host and,
    when the request resumes, copied back; twice a fetch."""
    return 2 * kv_fetch_time_s(num_tokens, kv_bytes_per_token, bandwidth_bytes_per_s)


def kv_fetch_time_s(
    num_tokens: int, kv_bytes_per_token: float, bandwidth_bytes_per_s: float
) -> float:
    """Seconds to move num_tokens tokens' KV over a link: n * b / B."""
    if num_tokens < 0 or kv_bytes_per_token < 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError("expected num_tokens >= 0, kv_bytes_per_token >= 0, bandwidth > 0")
    return num_tokens * kv_bytes_per_token / bandwidth_bytes_per_s


def recompute_flops(config: ModelConfig, num_tokens: int) -> float:
    """FLOPs of a prefill over num_tokens tokens (the LM head for the last token included)."""
    return roofline.prefill_cost(config, num_tokens).flops


def recompute_time_s(
    config: ModelConfig, num_tokens: int, peak_flops_per_s: float, mfu: float
) -> float:
    """Seconds to recompute num_tokens tokens' KV by prefill at a sustained mfu * peak FLOP/s."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return recompute_flops(config, num_tokens) / (peak_flops_per_s * mfu)


def break_even_bandwidth_bytes_per_s(
    kv_bytes_per_token: float, flops_per_token: float, sustained_flops_per_s: float
) -> float:
    """The link bandwidth at which fetching a token's KV takes as long as recomputing it.

    b / B = f / S  =>  B = b * S / f, with b bytes and f FLOPs per token and S FLOP/s sustained.
    A faster link makes offload win; a slower one makes recompute win.
    """
    if kv_bytes_per_token <= 0 or flops_per_token <= 0 or sustained_flops_per_s <= 0:
        raise ValueError("bytes, FLOPs per token and FLOP/s must all be > 0")
    return kv_bytes_per_token * sustained_flops_per_s / flops_per_token


def measure_fetch_bandwidth_bytes_per_s(
    num_bytes: int = 64 * MiB, device: str | None = None, repeats: int = 5
) -> float:
    """This machine's rate for bringing offloaded KV back: bytes/s of the fastest of `repeats`
    copies of `num_bytes` from host memory to the device that runs the model.

    On a CUDA machine: pinned host memory to the GPU, over PCIe (or NVLink-C2C). Without a GPU,
    host memory is the model's memory too, and the copy is a memcpy within it.
    """
    if num_bytes < 1 or repeats < 1:
        raise ValueError(f"num_bytes and repeats must be >= 1, got {num_bytes}, {repeats}")
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = target.type == "cuda"
    src = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=on_gpu)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=target)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy warms up
        if on_gpu:
            torch.cuda.synchronize(target)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize(target)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best
