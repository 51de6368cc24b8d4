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

`simulate_scaler` closes the loop over a fleet: a target-tracking scaler (the rule of
Kubernetes' HorizontalPodAutoscaler and of KEDA, which feeds it) reads the demand every
`sync_s` seconds, running plus waiting requests, and asks for

    desired = ceil(demand / (seats * target_usage))

replicas. Replicas it launches take traffic only after `cold_start_s`, and it counts them
as capacity while they start, or every sync during a cold start would launch more. It
scales down only to the largest `desired` of the last `scale_down_window_s` (the HPA's
stabilization window, 300 s by default), so a dip does not remove replicas that the next
burst needs (flapping). `target_usage` below 1 is the headroom: the spare seats carry the
load's growth during the lead time, one cold start plus up to one sync period.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """Means over the simulated time of the three autoscaling signals."""

    utilization: float
    kv_usage: float
    queue: float


def serve_tick(
    t: float, running: deque[float], waiting: deque[float], seats: int, service_s: float
) -> list[float]:
    """One tick of `seats` seats, first come first served: the requests whose service has
    ended by `t` leave (`running`: finish times, in order), then waiting requests
    (`waiting`: arrival times) take the free seats for `service_s` each. Returns the
    arrival times of the requests seated."""
    while running and running[0] <= t + 1e-9:  # a tick's float sum may land just short
        running.popleft()
    seated = []
    while waiting and len(running) < seats:
        seated.append(waiting.popleft())
        running.append(t + service_s)
    return seated


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
    running: deque[float] = deque()  # when each running request finishes
    waiting: deque[float] = deque()  # when each waiting request arrived
    busy = 0
    kv = queue = 0.0
    steps = int(seconds / dt)
    for i in range(steps):
        t = i * dt
        waiting.extend([t] * int(rng.poisson(rate_per_s * dt)))
        serve_tick(t, running, waiting, max_running, service_s)
        busy += bool(running)
        kv += len(running) / max_running
        queue += len(waiting)
    return ReplicaSignals(busy / steps, kv / steps, queue / steps)


def desired_replicas(demand: int, seats: int, target_usage: float, max_replicas: int) -> int:
    """Target tracking: enough replicas to hold `demand` requests at `target_usage` of their
    seats, at least 1 and at most `max_replicas`."""
    return min(max_replicas, max(1, math.ceil(demand / (seats * target_usage))))


def fleet_after_sync(
    current: int,
    demand: int,
    seats: int,
    target_usage: float,
    recent_desired: Sequence[int],
    max_replicas: int,
) -> int:
    """The fleet size a sync leaves: up at once to the desired count; down only to the
    largest count desired now or at the syncs of the stabilization window
    (`recent_desired`)."""
    desired = desired_replicas(demand, seats, target_usage, max_replicas)
    return max(desired, min(current, max([desired, *recent_desired])))


@dataclass(frozen=True, slots=True)
class ScalerTrace:
    """A scaled fleet over time (one row a tick) and what its requests waited."""

    t_s: np.ndarray
    rate_per_s: np.ndarray  # the offered load
    ready: np.ndarray  # replicas taking traffic
    starting: np.ndarray  # replicas in their cold start
    queue: np.ndarray  # requests waiting for a seat
    waits_s: np.ndarray  # each admitted request's wait, in arrival order
    arrived_s: np.ndarray  # when each of those requests arrived (the fleet starts empty,
    # so the first service time is a start-up transient to leave out)
    replica_s: float  # replica-seconds paid for (starting ones included)


def simulate_scaler(
    rate_at: Callable[[float], float],
    *,
    seconds: float,
    service_s: float,
    seats: int,
    cold_start_s: float,
    target_usage: float,
    initial_replicas: int,
    sync_s: float = 15.0,
    scale_down_window_s: float = 300.0,
    max_replicas: int = 64,
    dt: float = 0.25,
    seed: int = 0,
) -> ScalerTrace:
    """A fleet of `seats`-seat replicas under Poisson arrivals at `rate_at(t)` per second,
    each request holding a seat for `service_s`, sized by a target-tracking scaler."""
    if not 0 < target_usage <= 1:
        raise ValueError(f"target_usage must be in (0, 1], got {target_usage}")
    if seats < 1 or not 1 <= initial_replicas <= max_replicas:
        raise ValueError("expected seats >= 1 and 1 <= initial_replicas <= max_replicas")
    if service_s <= 0 or cold_start_s < 0 or sync_s < dt or dt <= 0 or seconds <= 0:
        raise ValueError("expected service_s > 0, cold_start_s >= 0 and dt <= sync_s")
    rng = np.random.default_rng(seed)
    ready, starting = initial_replicas, deque[float]()  # starting: when each is up
    running: deque[float] = deque()  # finish times (one service time: in order)
    waiting: deque[float] = deque()  # arrival times
    # the start counts as a decision, so the first empty syncs do not scale the fleet down
    desired_history: deque[tuple[float, int]] = deque([(0.0, initial_replicas)])
    rows, waits, arrived, replica_s = [], [], [], 0.0
    sync_every = round(sync_s / dt)
    for i in range(int(seconds / dt)):
        t = i * dt
        rate = rate_at(t)
        waiting.extend([t] * int(rng.poisson(rate * dt)))
        while starting and starting[0] <= t:
            starting.popleft()
            ready += 1
        # a removed replica drains: its requests keep their seats until they finish
        for arrival in serve_tick(t, running, waiting, ready * seats, service_s):
            arrived.append(arrival)
            waits.append(t - arrival)
        if i % sync_every == 0:
            while desired_history and desired_history[0][0] < t - scale_down_window_s:
                desired_history.popleft()
            demand = len(running) + len(waiting)
            window = [d for _, d in desired_history]
            fleet = fleet_after_sync(
                ready + len(starting), demand, seats, target_usage, window, max_replicas
            )
            desired_history.append((t, desired_replicas(demand, seats, target_usage, max_replicas)))
            while ready + len(starting) < fleet:
                starting.append(t + cold_start_s)
            while ready + len(starting) > fleet:  # cancel a start before stopping one
                if starting:
                    starting.pop()
                else:
                    ready -= 1
        rows.append((t, rate, ready, len(starting), len(waiting)))
        replica_s += (ready + len(starting)) * dt
    cols = np.array(rows).T
    return ScalerTrace(
        cols[0], cols[1], cols[2], cols[3], cols[4], np.array(waits), np.array(arrived), replica_s
    )
