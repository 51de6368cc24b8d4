"""What the launchers ask of the device: its SM count and shared memory per program.

Block sizes trade parallelism against the shared memory a program's pipelined tiles take
(num_stages copies of its K/V or weight tiles in flight). A Hopper SM gives one program up
to 227 KiB, an RTX 4090 99 KiB, a T4 64 KiB; a configuration that does not fit fails to
launch, so the launchers size their pipelines from these numbers. Under the interpreter
there is no device: notional values stand in.
"""

from __future__ import annotations

import functools

import torch

from kernels import INTERPRETED

NOTIONAL_SM_COUNT = 4  # under the interpreter: small, so that tests see several splits
NOTIONAL_SHARED_MEMORY_BYTES = 1 << 30


@functools.cache
def _cuda_properties(index: int) -> tuple[int, int]:
    import triton

    shared = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return torch.cuda.get_device_properties(index).multi_processor_count, shared


def sm_count(device: torch.device) -> int:
    if INTERPRETED or device.type != "cuda":
        return NOTIONAL_SM_COUNT
    return _cuda_properties(device.index if device.index is not None else 0)[0]


def max_shared_memory_bytes(device: torch.device) -> int:
    if INTERPRETED or device.type != "cuda":
        return NOTIONAL_SHARED_MEMORY_BYTES
    return _cuda_properties(device.index if device.index is not None else 0)[1]


def fit_num_stages(
    fixed_bytes: int, bytes_per_stage: int, max_stages: int, device: torch.device
) -> int:
    """The most pipeline stages, up to max_stages, whose tiles fit in shared memory; 0 when
    not even one does (the caller then shrinks its tiles)."""
    budget = max_shared_memory_bytes(device) - fixed_bytes
    return max(0, min(max_stages, budget // bytes_per_stage))
