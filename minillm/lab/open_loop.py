"""Open-loop load: requests arrive on a schedule, whether or not earlier ones are done.

`run_open_loop` plays timed requests into an `LLMEngine` in real time. Before every step it
queues each request whose arrival time has passed, stamped with that arrival time, so its
latencies count from when it arrived rather than from when the loop got round to it. After
every step it samples the engine's own gauges (`EngineStats.num_waiting`, `num_running`), as a
metrics scraper would. When nothing is in flight it sleeps until the next arrival.

A step is not interrupted: a request that arrives during a step reaches the engine's queue only
when the step is over. That delay is part of its measured waiting time but never of the
waiting gauge, just as a real server's front end (HTTP, tokenization) holds requests that the
engine's gauge does not count yet. Little's law makes the difference visible.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from minillm.core.metrics import RequestMetrics
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """A prompt (text or token ids) that arrives `arrival_s` seconds after the run starts."""

    arrival_s: float
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0


@dataclass(frozen=True, slots=True)
class GaugeSample:
    time_s: float  # when the step began, in seconds since the start of the run
    num_waiting: int
    num_running: int


@dataclass(slots=True)
class OpenLoopRun:
    """Per-request metrics (in the order of the requests) and gauge samples of one run.

    Times in `metrics` are on the engine's clock; `start_time` is the run's zero on it.
    """

    start_time: float
    end_time: float
    metrics: list[RequestMetrics]
    queued_times: list[float]  # engine clock: when each request reached the engine's queue
    gauge: list[GaugeSample] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return self.end_time - self.start_time

    @property
    def arrival_rate_per_s(self) -> float:
        """λ: requests per second over the whole run."""
        return len(self.metrics) / self.duration_s

    @property
    def mean_queueing_time_s(self) -> float:
        """W: mean time from arrival to being scheduled for the first time."""
        return statistics.fmean(m.queueing_time_s for m in self.metrics)

    @property
    def mean_engine_queueing_time_s(self) -> float:
        """Mean time from reaching the engine's queue to being scheduled."""
        return statistics.fmean(
            m.first_scheduled_time - queued
            for m, queued in zip(self.metrics, self.queued_times, strict=True)
        )

    @property
    def mean_num_waiting(self) -> float:
        """L from the gauge: the waiting count averaged over time, each sample held until the
        next (zero before the first)."""
        return time_average([(s.time_s, s.num_waiting) for s in self.gauge], self.duration_s)


def time_average(samples: Sequence[tuple[float, float]], end_s: float) -> float:
    """Average over [0, end_s] of a step function that takes value v at time t for each sample
    (t, v), holds it until the next sample, and is 0 before the first."""
    ends = [t for t, _ in samples[1:]] + [end_s]
    total = sum(
        v * max(0.0, min(t_next, end_s) - t)
        for (t, v), t_next in zip(samples, ends[: len(samples)], strict=True)
    )
    return total / end_s


def poisson_arrival_times(rate_per_s: float, num_requests: int, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process: exponential gaps with mean 1 / rate_per_s."""
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be positive, got {rate_per_s}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, num_requests)
    return np.cumsum(gaps).tolist()


def run_open_loop(engine: LLMEngine, requests: Sequence[TimedRequest]) -> OpenLoopRun:
    """Serve `requests` (sorted by arrival) in real time; returns their metrics and the gauges.

    The engine must be idle and use a real clock (the default, time.perf_counter).
    """
    if engine.has_unfinished_requests():
        raise ValueError("the engine must be idle at the start of an open-loop run")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    start = engine.clock()
    queued_times = [0.0] * len(requests)
    metrics: list[RequestMetrics | None] = [None] * len(requests)
    run = OpenLoopRun(start, start, [], [])
    next_index = 0
    while next_index < len(order) or engine.has_unfinished_requests():
        now = engine.clock()
        while next_index < len(order) and requests[order[next_index]].arrival_s <= now - start:
            i = order[next_index]
            request = requests[i]
            request_id = f"open-loop-{i}"
            engine.add_request(
                request_id,
                request.prompt,
                request.params,
                arrival_time=start + request.arrival_s,
                priority=request.priority,
            )
            metrics[i] = engine.output_processor.states[request_id].seqs[0].metrics
            queued_times[i] = now
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + requests[order[next_index]].arrival_s - engine.clock()))
            continue
        # the counts after a step hold while it runs: the queue changes only between steps
        # (arrivals join it, the next schedule takes from it), so each sample is stamped with
        # its step's start and held until the next step starts
        step_start = engine.clock()
        engine.step()
        stats = engine.stats
        run.gauge.append(GaugeSample(step_start - start, stats.num_waiting, stats.num_running))
    run.end_time = engine.clock()
    run.metrics = metrics
    run.queued_times = queued_times
    return run
