"""vLLM's batch defaults by GPU, as `EngineArgs.get_batch_defaults` sets them (vLLM 0.10).

A model of vLLM's rule, not minillm's (minillm's defaults are in minillm/engine/args.py):
GPUs with at least 70 GiB of memory, the A100 excepted, get more seats and a larger token
budget. The memory is what CUDA reports (`DeviceSpec.runtime_memory_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.lab.hardware import DeviceSpec
from minillm.lab.units import GiB

LARGE_GPU_BYTES = 70 * GiB  # vLLM: device_memory >= 70 GiB and "a100" not in the name


@dataclass(frozen=True, slots=True)
class BatchDefaults:
    max_num_seqs: int
    max_num_batched_tokens_offline: int  # the `LLM` class
    max_num_batched_tokens_server: int  # the OpenAI-compatible server


def vllm_batch_defaults(device: DeviceSpec) -> BatchDefaults:
    """`max_num_seqs` and `max_num_batched_tokens` vLLM 0.10 picks for `device`."""
    large = device.runtime_memory_bytes() >= LARGE_GPU_BYTES and "a100" not in device.name.lower()
    if large:
        return BatchDefaults(1024, 16384, 8192)
    return BatchDefaults(256, 8192, 2048)
