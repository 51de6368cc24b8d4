"""What the launchers ask of the device: its SM count and shared memory per program.

Block sizes trade parallelism against the shared memory a program's pipelined tiles take
(num_stages copies of its K/V or weight tiles in flight). A Hopper SM gives one program up
to 227 KiB, an RTX 4090 99 KiB, a T4 64 KiB; a configuration that does not fit fails to
launch, so the launchers size their pipelines from these numbers. Under the interpreter
there is no device: notional values stand in.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kernels import INTERPRETED

NOTIONAL_SM_COUNT = 4  # under the interpreter: small, so that tests see several splits
NOTIONAL_SHARED_MEMORY_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class AssumedGPU:
    compute_capability: tuple[int, int]
    sm_count: int


_assumed: AssumedGPU | None = None


@contextlib.contextmanager
def assume_gpu(compute_capability: tuple[int, int], num_sms: int) -> Iterator[None]:
    """Inside this block the launchers size their tiles, pipelines and splits for a GPU of
    this compute capability with num_sms SMs, whatever device they are given: what
    `minillm.lab.aot` needs to compile, without a GPU, exactly what would run on one."""
    global _assumed
    if compute_capability not in ARCH_LIMITS:
        raise ValueError(
            f"no limits for compute capability {compute_capability}; known: {sorted(ARCH_LIMITS)}"
        )
    previous, _assumed = _assumed, AssumedGPU(compute_capability, num_sms)
    try:
        yield
    finally:
        _assumed = previous


@functools.cache
def _cuda_properties(index: int) -> tuple[int, int, tuple[int, int]]:
    import triton

    shared = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, shared, (props.major, props.minor)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    if _assumed is not None:
        return _assumed.sm_count
    if INTERPRETED or device.type != "cuda":
        return NOTIONAL_SM_COUNT
    return _cuda_properties(_index(device))[0]


def max_shared_memory_bytes(device: torch.device) -> int:
    if _assumed is not None:
        return ARCH_LIMITS[_assumed.compute_capability].shared_memory_per_program
    if INTERPRETED or device.type != "cuda":
        return NOTIONAL_SHARED_MEMORY_BYTES
    return _cuda_properties(_index(device))[1]


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None under the interpreter or off CUDA."""
    if _assumed is not None:
        return _assumed.compute_capability
    if INTERPRETED or device.type != "cuda":
        return None
    return _cuda_properties(_index(device))[2]


def tensor_core_dots(itemsize: int, device: torch.device) -> bool:
    """Whether Triton compiles a kernel's dots for this device to tensor-core instructions:
    16-bit inputs on Ampere or later (mma.sync, Hopper's wgmma). float32 inputs ask for IEEE
    dots, and Triton compiles Turing's (sm_75) dots to FMA instructions on the CUDA cores;
    those kernels keep every operand in registers and need smaller tiles. True for a device
    it cannot tell (the interpreter, an unknown GPU)."""
    cc = compute_capability(device)
    return itemsize == 2 and (cc is None or cc >= (8, 0))


def fit_num_stages(
    fixed_bytes: int, bytes_per_stage: int, max_stages: int, device: torch.device
) -> int:
    """The most pipeline stages, up to max_stages, whose tiles fit in shared memory; 0 when
    not even one does (the caller then shrinks its tiles)."""
    budget = max_shared_memory_bytes(device) - fixed_bytes
    return max(0, min(max_stages, budget // bytes_per_stage))


@dataclass(frozen=True, slots=True)
class ArchLimits:
    """What one SM of a CUDA compute capability holds at once (CUDA C++ Programming Guide,
    "Features and Technical Specifications", table of technical specifications per compute
    capability; 1 KiB = 1024 bytes)."""

    compute_capability: tuple[int, int]
    shared_memory_per_sm: int  # bytes, shared by the programs resident on the SM
    shared_memory_per_program: int  # bytes one program may use (opt-in maximum)
    reserved_shared_memory_per_program: int  # bytes the system keeps per resident program
    max_warps_per_sm: int
    max_programs_per_sm: int  # "maximum number of resident blocks per SM"
    registers_per_sm: int  # 32-bit registers
    register_allocation_unit: int = 256  # registers are given to a warp in units of this


ARCH_LIMITS: dict[tuple[int, int], ArchLimits] = {
    limits.compute_capability: limits
    for limits in (
        ArchLimits((7, 5), 64 * 1024, 64 * 1024, 0, 32, 16, 65536),  # Turing: T4
        ArchLimits((8, 0), 164 * 1024, 163 * 1024, 1024, 64, 32, 65536),  # A100
        ArchLimits((8, 6), 100 * 1024, 99 * 1024, 1024, 48, 16, 65536),  # RTX 30xx, A10
        ArchLimits((8, 9), 100 * 1024, 99 * 1024, 1024, 48, 24, 65536),  # Ada: L4, L40S, 4090
        ArchLimits((9, 0), 228 * 1024, 227 * 1024, 1024, 64, 32, 65536),  # Hopper: H100, H200
    )
}

# the compute capability of each NVIDIA GPU in `minillm.lab.hardware`
DEVICE_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "H100 SXM": (9, 0),
    "H200 SXM": (9, 0),
    "A100 SXM 80GB": (8, 0),
    "L40S": (8, 9),
    "L4": (8, 9),
    "T4": (7, 5),
    "RTX 4090": (8, 9),
}


@dataclass(frozen=True, slots=True)
class Occupancy:
    programs_per_sm: int  # resident at once
    warps_per_sm: int
    fraction: float  # warps_per_sm / max_warps_per_sm
    limiter: str  # "warps", "programs", "shared memory" or "registers"


def occupancy(
    compute_capability: tuple[int, int],
    num_warps: int,
    shared_bytes: int,
    registers_per_thread: int = 0,
) -> Occupancy:
    """How many programs (thread blocks) of `num_warps` warps, each using `shared_bytes` of
    shared memory and `registers_per_thread` registers, one SM holds at once; the least of
    four limits, as CUDA's occupancy calculator computes it. 0 registers leaves registers
    out of the count (they are known only once a kernel is compiled for a GPU)."""
    if compute_capability not in ARCH_LIMITS:
        raise ValueError(
            f"no limits for compute capability {compute_capability}; known: {sorted(ARCH_LIMITS)}"
        )
    arch = ARCH_LIMITS[compute_capability]
    if num_warps < 1 or num_warps > arch.max_warps_per_sm:
        raise ValueError(f"num_warps must be in 1..{arch.max_warps_per_sm}, got {num_warps}")
    if not 0 <= shared_bytes <= arch.shared_memory_per_program:
        raise ValueError(
            f"shared_bytes must be in 0..{arch.shared_memory_per_program} on "
            f"sm_{compute_capability[0]}{compute_capability[1]}, got {shared_bytes}"
        )
    if not 0 <= registers_per_thread <= 255:
        raise ValueError(f"registers_per_thread must be in 0..255, got {registers_per_thread}")
    limits = {
        "warps": arch.max_warps_per_sm // num_warps,
        "programs": arch.max_programs_per_sm,
    }
    if shared_bytes:
        per_program = shared_bytes + arch.reserved_shared_memory_per_program
        limits["shared memory"] = arch.shared_memory_per_sm // per_program
    if registers_per_thread:
        unit = arch.register_allocation_unit
        per_warp = -(-registers_per_thread * 32 // unit) * unit
        limits["registers"] = (arch.registers_per_sm // per_warp) // num_warps
    limiter = min(limits, key=limits.__getitem__)
    programs = limits[limiter]
    warps = programs * num_warps
    return Occupancy(programs, warps, warps / arch.max_warps_per_sm, limiter)
