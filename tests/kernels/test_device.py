"""kernels.device: the per-architecture limits and the occupancy they allow."""

import pytest

from kernels.device import ARCH_LIMITS, DEVICE_COMPUTE_CAPABILITY, occupancy
from minillm.lab.hardware import DEVICES


def test_shared_memory_per_program_matches_cudas_opt_in_maxima():
    # cudaDevAttrMaxSharedMemoryPerBlockOptin as CUDA reports it, in bytes
    reported = {(7, 5): 65536, (8, 0): 166912, (8, 9): 101376, (9, 0): 232448}
    for cc, value in reported.items():
        assert ARCH_LIMITS[cc].shared_memory_per_program == value
    for limits in ARCH_LIMITS.values():
        # one program's maximum plus its reservation fits in the SM
        assert (
            limits.shared_memory_per_program + limits.reserved_shared_memory_per_program
            <= limits.shared_memory_per_sm
        )


def test_every_nvidia_device_has_a_compute_capability():
    nvidia = {d.name for d in DEVICES.values() if d.compute_unit == "SM"}
    assert nvidia == set(DEVICE_COMPUTE_CAPABILITY)
    assert set(DEVICE_COMPUTE_CAPABILITY.values()) <= set(ARCH_LIMITS)


@pytest.mark.parametrize(
    "cc, warps, shared, regs, expected",
    [
        # worked by hand from the architecture tables:
        # 8 warps, no shared memory, 32 registers: 64 warps / 8 = 8 programs, all warps busy
        ((8, 0), 8, 0, 32, (8, 64, 1.0, "warps")),
        # 48 KiB (+1 KiB reserved) each: 164 KiB // 49 KiB = 3 programs = 24 of 64 warps
        ((8, 0), 8, 48 * 1024, 32, (3, 24, 0.375, "shared memory")),
        # 128 registers x 32 threads = 4096 per warp: 65536 // 4096 = 16 warps = 4 programs
        ((9, 0), 4, 0, 128, (4, 16, 0.25, "registers")),
        # 1 warp each: the 32-program limit binds before 64 warps
        ((9, 0), 1, 0, 0, (32, 32, 0.5, "programs")),
        # Ada holds 48 warps and 24 programs: 2-warp programs stop at 24
        ((8, 9), 2, 0, 0, (24, 48, 1.0, "warps")),
        # 33 registers round up to 40 per thread (1280 per warp): 51 warps -> 12 programs of 4
        ((8, 9), 4, 0, 33, (12, 48, 1.0, "warps")),
        ((7, 5), 4, 40 * 1024, 0, (1, 4, 0.125, "shared memory")),
    ],
)
def test_occupancy_worked_examples(cc, warps, shared, regs, expected):
    occ = occupancy(cc, warps, shared, regs)
    assert (occ.programs_per_sm, occ.warps_per_sm, occ.fraction, occ.limiter) == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (((6, 1), 4, 0), "no limits for compute capability"),
        (((9, 0), 0, 0), "num_warps must be in 1..64"),
        (((8, 9), 4, 200 * 1024), "shared_bytes must be in 0..101376 on sm_89"),
        (((9, 0), 4, 0, 256), "registers_per_thread must be in 0..255"),
    ],
)
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        occupancy(*args)
