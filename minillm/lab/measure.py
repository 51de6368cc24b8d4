"""Measure this machine: achieved matmul FLOP/s and memory bandwidth, in a few seconds.

A datasheet gives peaks the hardware can reach in principle; a measurement gives what
PyTorch reaches on it now. Both go through the same stopwatch, `best_time_s`: run the
operation once to warm up (allocations, thread pools, kernel selection), then `repeats`
times, and keep the fastest run. The fastest run is the one least disturbed by other
programs, which is what a peak is about. On CUDA the device is synchronized before the
clock is read, because kernels launch asynchronously.

Counting the work is where measurements go wrong, so each function states it:

- a matmul [m, k] x [k, n] does 2*m*k*n FLOPs (one multiply and one add per term) and
  moves at least (m*k + k*n + m*n) elements;
- a read (`x.sum()`) of a tensor of S bytes moves S bytes;
- a copy (`dst.copy_(src)`) moves 2*S bytes: S read and S written. (A CPU may also read
  the destination into its cache before writing it; that traffic is not counted, as in
  the STREAM benchmark.)
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from minillm.lab.hardware import DeviceSpec, compute_format
from minillm.lab.units import MiB
from minillm.model.config import torch_dtype


@dataclass(frozen=True, slots=True)
class Measurement:
    """One timed operation: what it was, the work it does, and its best time."""

    what: str  # e.g. "matmul [1024, 1024] x [1024, 1024] float32"
    flops: float
    num_bytes: float  # bytes it must move to or from memory
    seconds: float  # best of the timed runs

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.num_bytes


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` as a torch.device; None means CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"can measure 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    return device


def best_time_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The shortest wall-clock time of `repeats` calls of `fn`, after one warm-up call."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemm(
    m: int,
    k: int,
    n: int,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "float32",
    repeats: int = 3,
) -> Measurement:
    """Time `a @ b` with a: [m, k], b: [k, n]; work 2*m*k*n FLOPs, (mk + kn + mn) elements."""
    dev = resolve_device(device)
    tdtype = torch_dtype(dtype)
    a = torch.randn(m, k, device=dev, dtype=tdtype)
    b = torch.randn(k, n, device=dev, dtype=tdtype)
    out = torch.empty(m, n, device=dev, dtype=tdtype)
    seconds = best_time_s(lambda: torch.matmul(a, b, out=out), repeats, dev)
    element_bytes = a.element_size()
    return Measurement(
        what=f"matmul [{m}, {k}] x [{k}, {n}] {str(tdtype).removeprefix('torch.')}",
        flops=2.0 * m * k * n,
        num_bytes=float((m * k + k * n + m * n) * element_bytes),
        seconds=seconds,
    )


def default_matmul_dtype(device: str | torch.device | None = None) -> str:
    """The format a model runs in on `device`: bfloat16 on a GPU that has it natively, else
    float16 (T4, V100); float32 on a CPU, the format every CPU multiplies at full speed."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        return "float32"
    native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return "bfloat16" if native_bf16 else "float16"


def default_matmul_sizes(device: torch.device) -> tuple[int, ...]:
    """Square sizes large enough to reach the peak, small enough to finish in ~a second."""
    return (4096, 8192) if device.type == "cuda" else (512, 1024, 1536)


def measure_matmul_flops(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "float32",
    sizes: tuple[int, ...] | None = None,
    repeats: int = 3,
) -> Measurement:
    """The fastest square matmul of `sizes`: this machine's achieved peak FLOP/s."""
    dev = resolve_device(device)
    runs = [measure_gemm(s, s, s, dev, dtype, repeats) for s in sizes or default_matmul_sizes(dev)]
    return max(runs, key=lambda run: run.flops_per_s)


def default_bandwidth_bytes(device: torch.device) -> int:
    """A buffer far larger than any cache: 1 GiB on a GPU, 256 MiB on a CPU."""
    return 1024 * MiB if device.type == "cuda" else 256 * MiB


def measure_memory_bandwidth(
    device: str | torch.device | None = None,
    num_bytes: int | None = None,
    op: Literal["read", "copy"] = "read",
    repeats: int = 5,
) -> Measurement:
    """Time a read (`x.sum()`, moves S bytes) or a copy (moves 2*S bytes) of S = `num_bytes`."""
    dev = resolve_device(device)
    size = num_bytes or default_bandwidth_bytes(dev)
    x = torch.ones(size // 4, device=dev, dtype=torch.float32)
    buffer_bytes = x.numel() * x.element_size()
    if op == "read":
        moved = buffer_bytes
        seconds = best_time_s(lambda: x.sum(), repeats, dev)
    elif op == "copy":
        dst = torch.empty_like(x)
        moved = 2 * buffer_bytes
        seconds = best_time_s(lambda: dst.copy_(x), repeats, dev)
    else:
        raise ValueError(f"op must be 'read' or 'copy', got {op!r}")
    return Measurement(
        what=f"{op} of {buffer_bytes / MiB:.0f} MiB",
        flops=0.0,
        num_bytes=float(moved),
        seconds=seconds,
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_device(
    device: str | torch.device | None = None, dtypes: tuple[str, ...] | None = None
) -> DeviceSpec:
    """A `DeviceSpec` for this machine from measurements (`measured=True`).

    Peak FLOP/s per dtype of `dtypes` (default: `default_matmul_dtype`, and float32 on a
    GPU) from `measure_matmul_flops`; bandwidth is the better of a read and a copy.
    """
    dev = resolve_device(device)
    dtypes = dtypes or tuple(dict.fromkeys((default_matmul_dtype(dev), "float32")))
    peaks = {compute_format(d): measure_matmul_flops(dev, d).flops_per_s for d in dtypes}
    bandwidth = max(measure_memory_bandwidth(dev, op=op).bytes_per_s for op in ("read", "copy"))
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, memory_bytes, memory_type = props.name, props.total_memory, "GPU memory"
        units, unit = props.multi_processor_count, "SM"
    else:
        name = _cpu_name()
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        units, unit, memory_type = torch.get_num_threads(), "core", "DRAM"
    today = datetime.date.today()
    return DeviceSpec(
        name=f"this machine ({name})",
        peak_flops_per_s=types.MappingProxyType(peaks),
        sparse_flops_per_s=types.MappingProxyType({}),
        memory_bandwidth_bytes_per_s=bandwidth,
        memory_bytes=float(memory_bytes),
        memory_type=memory_type,
        num_compute_units=units,
        compute_unit=unit,
        source=f"measured by minillm.lab.measure with torch {torch.__version__} on {today}",
        source_date=today.strftime("%Y-%m"),
        measured=True,
    )


def measure_op_time(
    num_elements: int,
    device: str | torch.device | None = None,
    ops_per_run: int = 200,
    repeats: int = 5,
) -> Measurement:
    """Time one small elementwise operation, `torch.add(x, 1.0, out=y)` on float32 tensors
    of `num_elements`, as the best time of `ops_per_run` back-to-back calls divided by
    `ops_per_run`. Work: num_elements FLOPs; 8 * num_elements bytes (x read, y written).

    Back-to-back calls let a GPU overlap each launch with the previous kernel, as an eager
    model step does; so for tiny tensors the time per operation is the fixed cost of issuing
    one (Python, PyTorch's dispatcher, the driver's launch), and for large ones the time to
    move its bytes.
    """
    if num_elements < 1:
        raise ValueError(f"num_elements must be >= 1, got {num_elements}")
    if ops_per_run < 1:
        raise ValueError(f"ops_per_run must be >= 1, got {ops_per_run}")
    dev = resolve_device(device)
    x = torch.ones(num_elements, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)

    def run() -> None:
        for _ in range(ops_per_run):
            torch.add(x, 1.0, out=y)

    seconds = best_time_s(run, repeats, dev) / ops_per_run
    return Measurement(
        what=f"add of {num_elements} float32",
        flops=float(num_elements),
        num_bytes=float(8 * num_elements),
        seconds=seconds,
    )


@functools.cache
def this_machine(device: str | None = None) -> DeviceSpec:
    """The spec of this computer's CPU (or CUDA GPU, when one is present), measured once.

    `device` is "cpu" or "cuda"; None picks CUDA when available. The measurement takes a
    few seconds and is cached for the life of the process.
    """
    return measure_device(device)
