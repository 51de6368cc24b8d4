"""Cold start: how long a new minillm replica takes from `exec` to its first token, phase by
phase, and a warm pool of pre-started replicas simulated against starting them on demand.

`measure_cold_start` launches a fresh Python process that builds an `LLM` and answers one
one-token request, and timestamps it on the system's monotonic clock (CLOCK_MONOTONIC on
Linux, shared by every process, so the parent's launch time and the child's stamps compare):

    process         exec to the child's first statement (the interpreter starting up)
    import_torch    `import torch`
    import_minillm  `import minillm` and the engine's modules
    load_weights    `load_model`: config, tokenizer, safetensors into the model
    allocate_kv     the KV-cache pool (`allocate_kv_caches`)
    engine_other    the rest of `LLM(...)`: arguments, scheduler, sampler (CUDA graph capture
                    on a GPU)
    first_request   the first request, one output token: its prefill is the warm-up step
                    (lazy initialisation, Triton compilation on a GPU)

The phases are consecutive slices of one timeline, so they add up to the total. The two
engine phases are timed by wrapping the engine's own `load_model` and `allocate_kv_caches`
in the child (nothing of the engine changes). The bundled model is small, so on a CPU the
imports dominate; a GPU and an 8B model move the weight of the total to loading weights
(gigabytes from disk) and to compiling and capturing graphs.

`simulate_warm_pool` replays arrivals against k replicas started in advance: a request
that finds none idle launches a new one (ready `cold_start_s` later) and is served by the
first replica free, first come first served. Its wait distribution is what a warm pool buys.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

PHASES = (
    "process",
    "import_torch",
    "import_minillm",
    "load_weights",
    "allocate_kv",
    "engine_other",
    "first_request",
)

CHILD = r"""
import time
t_start = time.monotonic()
import json, sys
import torch
t_torch = time.monotonic()
import minillm
from minillm import LLM, SamplingParams
import minillm.engine.llm_engine as llm_engine
import minillm.worker.model_runner as model_runner
t_minillm = time.monotonic()
spans = {"load_weights": [], "allocate_kv": []}

def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            spans[name].append((t0, time.monotonic()))
    return wrapper

llm_engine.load_model = timed("load_weights", llm_engine.load_model)
model_runner.allocate_kv_caches = timed("allocate_kv", model_runner.allocate_kv_caches)
model, options = json.loads(sys.argv[1])
llm = LLM(model, **options) if model else LLM(**options)
t_engine = time.monotonic()
params = SamplingParams(temperature=0.0, max_tokens=1)
llm.generate(["Hello"], params, use_tqdm=False)
t_first = time.monotonic()
llm.generate(["Hello"], params, use_tqdm=False)
t_second = time.monotonic()
print("COLD_START " + json.dumps({
    "start": t_start, "torch": t_torch, "minillm": t_minillm, "engine": t_engine,
    "first": t_first, "second": t_second, "spans": spans,
}), flush=True)
"""


@dataclass(frozen=True, slots=True)
class ColdStart:
    """Seconds per phase of one cold start (see the module's table), in order."""

    process: float
    import_torch: float
    import_minillm: float
    load_weights: float
    allocate_kv: float
    engine_other: float
    first_request: float
    total: float  # launch to the first request's answer: the phases' sum
    warm_request: float  # the same request again, on the warm engine (not in the total)

    def phases(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PHASES}


def cold_start_from_stamps(launch: float, stamps: dict) -> ColdStart:
    """The phases from the parent's launch time and the child's timestamps."""
    spans = stamps["spans"]
    weights = sum(b - a for a, b in spans["load_weights"])
    kv = sum(b - a for a, b in spans["allocate_kv"])
    engine = stamps["engine"] - stamps["minillm"]
    return ColdStart(
        process=stamps["start"] - launch,
        import_torch=stamps["torch"] - stamps["start"],
        import_minillm=stamps["minillm"] - stamps["torch"],
        load_weights=weights,
        allocate_kv=kv,
        engine_other=engine - weights - kv,
        first_request=stamps["first"] - stamps["engine"],
        total=stamps["first"] - launch,
        warm_request=stamps["second"] - stamps["first"],
    )


def measure_cold_start(
    model: str | None = None, *, timeout_s: float = 300.0, **engine_options
) -> ColdStart:
    """One cold start of `model` (None: the bundled one) with EngineArgs options, in a fresh
    Python process (this interpreter's executable)."""
    payload = json.dumps([model, engine_options])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launch = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, payload],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("COLD_START ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the cold-start process failed: {done.stderr.strip()[-2000:]}")
    return cold_start_from_stamps(launch, json.loads(lines[-1].removeprefix("COLD_START ")))


# ------------------------------------------------------------------------------ warm pool


@dataclass(frozen=True, slots=True)
class WarmPoolRun:
    """What the requests saw: each one's wait before service, and the replicas launched."""

    waits_s: tuple[float, ...]
    launched: int  # replicas cold-started on demand
    warm: int  # replicas started in advance
    replica_s: float  # replica-seconds paid for, from each start to the last request's end

    def percentile(self, p: float) -> float:
        """The p-th percentile wait (nearest rank)."""
        ordered = sorted(self.waits_s)
        if not ordered:
            return math.nan
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

    @property
    def mean_wait_s(self) -> float:
        return sum(self.waits_s) / len(self.waits_s) if self.waits_s else math.nan

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(mean_wait_s=self.mean_wait_s, p50_s=self.percentile(50))
        out.update(p90_s=self.percentile(90), p99_s=self.percentile(99))
        return out


def simulate_warm_pool(
    arrival_times_s: Sequence[float],
    service_times_s: Sequence[float] | float,
    *,
    warm_replicas: int,
    cold_start_s: float,
    max_replicas: int | None = None,
    slots_per_replica: int = 1,
) -> WarmPoolRun:
    """First come first served over replicas serving `slots_per_replica` requests at a time.

    `warm_replicas` are ready at time 0. A request that arrives when no slot is free
    launches one replica (ready `cold_start_s` later; none past `max_replicas`), then starts
    on the slot free soonest (ties: the replica started first). Replicas stay up once
    started, and are paid for from their start (warm ones from 0) to the last request's end:
    without `max_replicas` a burst launches a replica per waiting request."""
    if warm_replicas < 0 or cold_start_s < 0:
        raise ValueError("expected warm_replicas >= 0 and cold_start_s >= 0")
    if max_replicas is not None and max_replicas < max(1, warm_replicas):
        raise ValueError(f"max_replicas must be >= max(1, warm_replicas), got {max_replicas}")
    if slots_per_replica < 1:
        raise ValueError(f"slots_per_replica must be >= 1, got {slots_per_replica}")
    n = len(arrival_times_s)
    services = (
        [float(service_times_s)] * n
        if isinstance(service_times_s, int | float)
        else [float(s) for s in service_times_s]
    )
    if len(services) != n or any(s < 0 for s in services):
        raise ValueError("service_times_s: one time >= 0 per arrival (or one for all)")
    if any(b < a for a, b in zip(arrival_times_s, arrival_times_s[1:], strict=False)):
        raise ValueError("arrival_times_s must be sorted")
    # (time a slot can start a request, replica); every replica has slots_per_replica slots
    free_at = [(0.0, i) for i in range(warm_replicas) for _ in range(slots_per_replica)]
    heapq.heapify(free_at)
    started = [0.0] * warm_replicas  # when each replica was started
    launched, waits, end = 0, [], 0.0
    for t, service in zip(arrival_times_s, services, strict=True):
        if (not free_at or free_at[0][0] > t) and (
            max_replicas is None or len(started) < max_replicas
        ):
            for _ in range(slots_per_replica):
                heapq.heappush(free_at, (t + cold_start_s, len(started)))
            started.append(t)
            launched += 1
        ready, replica = heapq.heappop(free_at)
        start = max(t, ready)
        waits.append(start - t)
        end = max(end, start + service)
        heapq.heappush(free_at, (start + service, replica))
    replica_s = sum(end - s for s in started) if waits else 0.0
    return WarmPoolRun(tuple(waits), launched, warm_replicas, replica_s)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    result = measure_cold_start(args.model)
    for name, seconds in result.phases().items():
        print(f"{name:15s} {seconds * 1e3:9.1f} ms  {seconds / result.total:6.1%}")
    print(f"{'total':15s} {result.total * 1e3:9.1f} ms; a warm request: "
          f"{result.warm_request * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
