"""Measure all-reduce on this machine with torch.distributed, and fit the alpha-beta model.

`measure_all_reduce` starts `world_size` processes (NCCL with a GPU per rank, else gloo on the
CPU, `ranks_device`: a one-GPU machine measures its CPU processes and says so), all-reduces
float32 tensors of each size a few times, and reports the median time per size as rank 0 saw
it, sizes interleaved round robin so that a burst of other work on the machine touches every
size alike. `fit_alpha_beta` fits t = a + b * n to those times by least squares: a is the
fixed cost of one all-reduce here, 1 / b its effective bandwidth.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minillm.distributed.parallel_state import ranks_device


@dataclass(frozen=True, slots=True)
class AllReduceTiming:
    """Median seconds and the spread (min, max) of the repeats, per message size in bytes."""

    world_size: int
    backend: str
    where: str  # which processes ran, and why (ranks_device)
    sizes_bytes: list[int]
    median_s: list[float]
    min_s: list[float]
    max_s: list[float]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    sizes: list[int],
    repeats: int,
    out_path: str,
    device_type: str = "cpu",
) -> None:
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        tensors = [torch.ones(n // 4, dtype=torch.float32, device=device) for n in sizes]
        for t in tensors:  # warm up every size once (connections, buffers)
            dist.all_reduce(t)
        times: list[list[float]] = [[] for _ in sizes]
        for _ in range(repeats):
            for i, t in enumerate(tensors):  # round robin over sizes
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                dist.all_reduce(t)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[i].append(time.perf_counter() - start)
        if rank == 0:
            torch.save({"backend": backend, "times": times}, out_path)
    finally:
        dist.destroy_process_group()


def measure_all_reduce(
    sizes_bytes: Sequence[int], world_size: int = 2, repeats: int = 7
) -> AllReduceTiming:
    """Time all-reduces of float32 tensors of `sizes_bytes` bytes over `world_size` processes."""
    if world_size < 2 or repeats < 1:
        raise ValueError(f"need world_size >= 2 and repeats >= 1, got {world_size}, {repeats}")
    device_type, where = ranks_device(world_size)
    sizes = [int(n) for n in sizes_bytes]
    if not sizes or any(n < 4 or n % 4 for n in sizes):
        raise ValueError("sizes must be multiples of 4 bytes (float32 elements), at least 4")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "times.pt")
        # one fresh interpreter per rank, as torchrun would start them
        port = str(_free_port())
        command = [
            sys.executable,
            "-m",
            __name__,
            "--world-size",
            str(world_size),
            "--port",
            port,
            "--repeats",
            str(repeats),
            "--out",
            out_path,
            "--device",
            device_type,
            "--sizes",
            *map(str, sizes),
        ]
        ranks = [subprocess.Popen([*command, "--rank", str(r)]) for r in range(world_size)]
        codes = [rank.wait(timeout=300) for rank in ranks]
        if any(codes):
            raise RuntimeError(f"an all-reduce rank failed (exit codes {codes})")
        result = torch.load(out_path)
    times = result["times"]
    return AllReduceTiming(
        world_size=world_size,
        backend=result["backend"],
        where=where,
        sizes_bytes=sizes,
        median_s=[statistics.median(t) for t in times],
        min_s=[min(t) for t in times],
        max_s=[max(t) for t in times],
    )


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = alpha + beta * n; returns (alpha seconds, beta seconds/byte)."""
    if len(sizes_bytes) != len(times_s) or len(set(sizes_bytes)) < 2:
        raise ValueError("need as many times as sizes, and at least two distinct sizes")
    n = len(sizes_bytes)
    mean_x, mean_y = sum(sizes_bytes) / n, sum(times_s) / n
    sxx = sum((x - mean_x) ** 2 for x in sizes_bytes)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes_bytes, times_s, strict=True))
    beta = sxy / sxx
    return mean_y - beta * mean_x, beta


def fit_alpha_beta_relative(
    sizes_bytes: Sequence[float], times_s: Sequence[float]
) -> tuple[float, float]:
    """t = alpha + beta * n fitted on relative error (least squares weighted by 1 / t^2).

    An unweighted fit lets the largest messages set the intercept: a 10 % wobble of a 16 MiB
    all-reduce moves alpha by milliseconds. Weighting each point by its own size of error
    lets the small messages, whose time is mostly alpha, set it."""
    if len(sizes_bytes) != len(times_s) or len(set(sizes_bytes)) < 2:
        raise ValueError("need as many times as sizes, and at least two distinct sizes")
    if min(times_s) <= 0:
        raise ValueError("times must be positive")
    w = [1 / t**2 for t in times_s]
    sw = sum(w)
    mean_x = sum(wi * x for wi, x in zip(w, sizes_bytes, strict=True)) / sw
    mean_y = sum(wi * y for wi, y in zip(w, times_s, strict=True)) / sw
    sxx = sum(wi * (x - mean_x) ** 2 for wi, x in zip(w, sizes_bytes, strict=True))
    sxy = sum(
        wi * (x - mean_x) * (y - mean_y) for wi, x, y in zip(w, sizes_bytes, times_s, strict=True)
    )
    beta = sxy / sxx
    return mean_y - beta * mean_x, beta


def main() -> None:
    """One rank of `measure_all_reduce` (it starts these itself)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    _worker(args.rank, args.world_size, args.port, args.sizes, args.repeats, args.out, args.device)


if __name__ == "__main__":
    main()
