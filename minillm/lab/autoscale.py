"""Autoscaling signals: what GPU utilization, KV usage and the queue say about one replica.

A model of a replica, not an engine feature: a replica runs at most `max_running` requests
at a time (its batch, bounded by the KV pool), each for `service_s` seconds; requests arrive
as a Poisson process at `rate_per_s` and wait in a first-come-first-served queue when the
batch is full. Time advances in ticks of `dt` seconds. Per tick we record

    utilization   whether at least one request runs (what `nvidia-smi` reports as GPU
                  utilization: the share of time a kernel runs)
    kv_usage      running / max_running (vLLM's kv_cache_usage_perc when every request
                  holds the same number of blocks)
    queue         requests waiting (vLLM's num_requests_waiting)

and report their means. Below capacity (`rate_per_s * service_s` well under `max_running`)
the number running is that of an M/D/infinity queue, Poisson with mean
`rate_per_s * service_s`, so utilization is near `1 - exp(-rate * service)` and KV usage near
`rate * service / max_running`: utilization saturates long before the replica is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """Means over the simulated time of the three autoscaling signals."""

    utilization: float
    kv_usage: float
    queue: float


def simulate_replica(
    rate_per_s: float,
    service_s: float,
    max_running: int,
    *,
    seconds: float = 600.0,
    dt: float = 0.05,
    seed: int = 0,
) -> ReplicaSignals:
    """Mean utilization, KV usage and queue of one replica under Poisson arrivals."""
    if rate_per_s < 0 or service_s <= 0 or dt <= 0 or seconds <= 0:
        raise ValueError("expected rate_per_s >= 0, service_s > 0, dt > 0 and seconds > 0")
    if not isinstance(max_running, int) or max_running < 1:
        raise ValueError(f"max_running must be an int >= 1, got {max_running!r}")
    rng = np.random.default_rng(seed)
    running: list[float] = []  # remaining service time of each running request
    waiting = busy = 0
    kv = queue = 0.0
    steps = int(seconds / dt)
    for _ in range(steps):
        waiting += int(rng.poisson(rate_per_s * dt))
        running = [r - dt for r in running if r - dt > 1e-12]
        while waiting and len(running) < max_running:
            running.append(service_s)
            waiting -= 1
        busy += bool(running)
        kv += len(running) / max_running
        queue += waiting
    return ReplicaSignals(busy / steps, kv / steps, queue / steps)
