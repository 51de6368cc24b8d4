"""Capacity planning in tokens: how many GPUs a load needs under an SLO, and what a million
tokens costs. A model of a deployment, built on chapters 2-5's models (the roofline step
times of `minillm.lab.roofline`, the devices of `minillm.lab.hardware`, the KV pool of
`minillm.lab.kv_memory`, vLLM's batch defaults of `minillm.lab.vllm_defaults`).

The steady state of one replica (one GPU) running `b` requests at a time, every request
with `input_len` prompt tokens and `output_len` output tokens:

- a decode step of the batch takes `t_d(b)`: its roofline floor at the mean context
  `input_len + output_len / 2`, divided by an efficiency (the fraction of the roofline an
  engine attains: measured MBU, e.g. 0.6-0.8 for a good GPU engine; 1.0 gives the floor);
- every request also needs its prefill, `t_p` (the prefill's roofline floor over the same
  efficiency). While b requests finish in output_len decode steps, b new ones are prefilled,
  so b requests take `output_len * t_d(b) + b * t_p` seconds:

      requests/s          X(b) = b / (output_len * t_d(b) + b * t_p)
      TPOT (mean)         t_d(b) + b * t_p / output_len   (the prefills spread over the steps,
                                                           as chunked prefill does)
      TTFT (no queueing)  t_p + t_d(b)                    (its prefill, then a step's wait)

- b is at most what the KV pool holds at the full length `input_len + output_len` and at
  most vLLM's `max_num_seqs` for the device. The planner takes the largest b whose TPOT and
  TTFT meet the SLO; `replicas = ceil(target requests/s / X(b))`.

Cost: a GPU at `price_per_gpu_hour` costs price / 3600 per second, so a replica at full
load makes tokens at X(b) * tokens per request per second, and a million of them cost
`1e6 * price / 3600 / (tokens per second)`. The deployment's cost counts what it is paid
for, every replica whether busy or not: `replicas * price / 3600 / (target tokens per s)`.

Queueing. The formulas above are means of a full replica: a request is assumed to find a
free seat at once. With arrivals at random, a replica is a `b`-seat queue (every request
holds a seat for `hold = b / X(b)` seconds, one cycle) and at a utilization near 1 some
requests wait for a seat, a wait the TTFT above leaves out. `Slo.ttft_percentile` plans for
it: the TTFT target then applies to that percentile of `t_p + t_d(b) + seat wait`, the wait
from Erlang C (`minillm.lab.queueing`, Poisson arrivals split evenly over the replicas,
exponential holding times, which overstate the wait of fixed-length requests a little),
and the planner adds replicas until it holds. `target_utilization` (< 1) is the cruder
rule of thumb. This model counts one GPU per replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from minillm.lab import queueing
from minillm.lab.catalog import get_model_config
from minillm.lab.hardware import DeviceSpec, get_device
from minillm.lab.kv_memory import layout_from_config, num_sequences_that_fit, vllm_kv_pool_bytes
from minillm.lab.roofline import (
    decode_step_cost,
    model_weight_bytes,
    prefill_cost,
    step_time_floor_s,
)
from minillm.lab.vllm_defaults import vllm_batch_defaults
from minillm.model.config import ModelConfig

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class Slo:
    """Targets on the mean TPOT and on the TTFT (seconds). With `ttft_percentile` None the
    TTFT target is for a request that finds a free seat; with a percentile (0.99: p99) it
    is for that percentile of the TTFT including the wait for a seat."""

    tpot_s: float
    ttft_s: float
    ttft_percentile: float | None = None

    def __post_init__(self) -> None:
        if self.ttft_percentile is not None and not 0 < self.ttft_percentile < 1:
            raise ValueError(f"ttft_percentile must be in (0, 1), got {self.ttft_percentile}")


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """One replica at a batch size: what it sustains and what a request sees."""

    batch_size: int
    decode_step_s: float
    prefill_s: float
    requests_per_s: float
    tpot_s: float
    ttft_s: float
    input_len: int
    output_len: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.requests_per_s * self.output_len

    @property
    def total_tokens_per_s(self) -> float:
        return self.requests_per_s * (self.input_len + self.output_len)

    def meets(self, slo: Slo) -> bool:
        return self.tpot_s <= slo.tpot_s and self.ttft_s <= slo.ttft_s


def operating_point(
    decode_step_s: Callable[[int], float],
    prefill_s: float,
    batch_size: int,
    input_len: int,
    output_len: int,
) -> OperatingPoint:
    """The steady state at `batch_size` from a decode step time per batch size and the
    prefill time of one request (see the module's formulas)."""
    if batch_size < 1 or input_len < 1 or output_len < 1:
        raise ValueError(
            "expected batch_size, input_len and output_len >= 1, got "
            f"{batch_size}, {input_len}, {output_len}"
        )
    t_d = decode_step_s(batch_size)
    cycle = output_len * t_d + batch_size * prefill_s
    return OperatingPoint(
        batch_size,
        t_d,
        prefill_s,
        requests_per_s=batch_size / cycle,
        tpot_s=t_d + batch_size * prefill_s / output_len,
        ttft_s=prefill_s + t_d,
        input_len=input_len,
        output_len=output_len,
    )


def best_operating_point(
    decode_step_s: Callable[[int], float],
    prefill_s: float,
    max_batch_size: int,
    input_len: int,
    output_len: int,
    slo: Slo,
) -> OperatingPoint | None:
    """The operating point of most requests/s within `max_batch_size` that meets the SLO
    (None: not even one request at a time does)."""
    best = None
    for b in range(1, max_batch_size + 1):
        point = operating_point(decode_step_s, prefill_s, b, input_len, output_len)
        if point.meets(slo) and (best is None or point.requests_per_s > best.requests_per_s):
            best = point
    return best


def replicas_needed(
    target_requests_per_s: float, requests_per_s_per_replica: float, target_utilization=1.0
) -> int:
    """ceil(target / (per replica * utilization)): the replicas that carry the load with
    each run at `target_utilization` of what it can sustain."""
    if target_requests_per_s < 0 or requests_per_s_per_replica <= 0:
        raise ValueError("expected target_requests_per_s >= 0 and a replica rate > 0")
    if not 0 < target_utilization <= 1:
        raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization}")
    return math.ceil(target_requests_per_s / (requests_per_s_per_replica * target_utilization))


def seat_hold_s(point: OperatingPoint) -> float:
    """How long a request holds its seat at `point`: one cycle, `b / X(b)` (Little's law)."""
    return point.batch_size / point.requests_per_s


def seat_wait_quantile_s(
    point: OperatingPoint, replicas: int, target_requests_per_s: float, q: float
) -> float:
    """The q-quantile of the wait for a seat when `replicas` replicas at `point` share
    Poisson arrivals at `target_requests_per_s` evenly (Erlang C on each replica's
    `batch_size` seats; inf when a replica is offered more than it can carry)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    hold = seat_hold_s(point)
    load = target_requests_per_s / replicas * hold
    if load >= point.batch_size:
        return math.inf
    return queueing.wait_quantile_s(point.batch_size, load, hold, q)


def replicas_for_ttft_percentile(
    point: OperatingPoint, target_requests_per_s: float, ttft_s: float, q: float
) -> int:
    """The fewest replicas at `point` whose q-quantile TTFT, `point.ttft_s` plus the
    q-quantile wait for a seat, is at most `ttft_s`."""
    budget = ttft_s - point.ttft_s
    if budget < 0:
        raise ValueError(
            f"the TTFT without a wait ({point.ttft_s:.4g} s) already exceeds {ttft_s:.4g} s"
        )
    replicas = max(1, math.floor(target_requests_per_s / point.requests_per_s) + 1)
    while seat_wait_quantile_s(point, replicas, target_requests_per_s, q) > budget:
        replicas += 1
    return replicas


def cost_per_million_tokens(price_per_gpu_hour: float, tokens_per_s_per_gpu: float) -> float:
    """Dollars (or the price's currency) per 10**6 tokens made at `tokens_per_s_per_gpu`."""
    if price_per_gpu_hour < 0 or tokens_per_s_per_gpu <= 0:
        raise ValueError("expected price_per_gpu_hour >= 0 and tokens_per_s_per_gpu > 0")
    return 1e6 * price_per_gpu_hour / SECONDS_PER_HOUR / tokens_per_s_per_gpu


def roofline_step_times(
    config: ModelConfig,
    device: DeviceSpec,
    input_len: int,
    output_len: int,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    efficiency: float = 1.0,
) -> tuple[Callable[[int], float], float]:
    """(decode step time per batch size, prefill time of one prompt) from the roofline
    floors (`step_time_floor_s`), at the mean context `input_len + output_len // 2`, with
    the device's peak and bandwidth scaled by `efficiency`."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    peak = device.peak_flops(dtype) * efficiency
    bandwidth = device.memory_bandwidth_bytes_per_s * efficiency
    context = input_len + output_len // 2

    def decode_step_s(b: int) -> float:
        cost = decode_step_cost(config, b, context, dtype, kv_dtype)
        return step_time_floor_s(cost, peak, bandwidth)

    prefill = prefill_cost(config, input_len, 1, dtype, kv_dtype)
    return decode_step_s, step_time_floor_s(prefill, peak, bandwidth)


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """What a load needs: replicas (GPUs), the operating point of each, and the costs."""

    model: str
    device: str
    max_batch_size: int  # the KV pool's and max_num_seqs' limit
    point: OperatingPoint  # each replica's operating point at the best batch size
    replicas: int
    price_per_gpu_hour: float
    cost_per_million_output_tokens_full_load: float
    cost_per_million_tokens_full_load: float  # input + output tokens
    cost_per_million_tokens_at_target: float  # all replicas paid, the target load's tokens
    utilization: float  # the target load over what the replicas can carry
    seat_wait_p99_s: float  # p99 wait for a seat at the target load (Erlang C)


def plan_capacity(
    model: str | ModelConfig,
    device: str | DeviceSpec,
    *,
    target_requests_per_s: float,
    input_len: int,
    output_len: int,
    slo: Slo,
    price_per_gpu_hour: float,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    efficiency: float = 1.0,
    gpu_memory_utilization: float = 0.9,
    target_utilization: float = 1.0,
) -> CapacityPlan:
    """Plan one-GPU replicas of `model` (a catalog name or a ModelConfig) on `device` (a
    hardware name or a DeviceSpec) for a load, under an SLO, at a GPU price."""
    config = get_model_config(model) if isinstance(model, str) else model
    spec = get_device(device) if isinstance(device, str) else device
    decode_step_s, prefill = roofline_step_times(
        config, spec, input_len, output_len, dtype, kv_dtype, efficiency
    )
    pool = vllm_kv_pool_bytes(
        spec.runtime_memory_bytes(), gpu_memory_utilization, model_weight_bytes(config, dtype), 0.0
    )
    fits = num_sequences_that_fit(
        pool, layout_from_config(config), input_len + output_len, kv_dtype or dtype
    )
    max_batch = min(fits, vllm_batch_defaults(spec).max_num_seqs)
    if max_batch < 1:
        raise ValueError(
            f"not one sequence of {input_len + output_len} tokens fits in the KV pool of "
            f"{pool:.4g} bytes on {spec.name}"
        )
    point = best_operating_point(decode_step_s, prefill, max_batch, input_len, output_len, slo)
    if point is None:
        one = operating_point(decode_step_s, prefill, 1, input_len, output_len)
        raise ValueError(
            f"the SLO (TPOT {slo.tpot_s * 1e3:.3g} ms, TTFT {slo.ttft_s * 1e3:.3g} ms) cannot be "
            f"met on {spec.name} even one request at a time (TPOT {one.tpot_s * 1e3:.3g} ms, "
            f"TTFT {one.ttft_s * 1e3:.3g} ms): a faster device, or tensor parallelism"
        )
    replicas = replicas_needed(target_requests_per_s, point.requests_per_s, target_utilization)
    if slo.ttft_percentile is not None and target_requests_per_s > 0:
        replicas = max(
            replicas,
            replicas_for_ttft_percentile(
                point, target_requests_per_s, slo.ttft_s, slo.ttft_percentile
            ),
        )
    target_tokens_per_s = target_requests_per_s * (input_len + output_len)
    at_target = (
        replicas * price_per_gpu_hour / SECONDS_PER_HOUR / target_tokens_per_s * 1e6
        if target_tokens_per_s
        else math.inf
    )
    return CapacityPlan(
        model=config.architecture if not isinstance(model, str) else model,
        device=spec.name,
        max_batch_size=max_batch,
        point=point,
        replicas=replicas,
        price_per_gpu_hour=price_per_gpu_hour,
        cost_per_million_output_tokens_full_load=cost_per_million_tokens(
            price_per_gpu_hour, point.output_tokens_per_s
        ),
        cost_per_million_tokens_full_load=cost_per_million_tokens(
            price_per_gpu_hour, point.total_tokens_per_s
        ),
        cost_per_million_tokens_at_target=at_target,
        utilization=target_requests_per_s / (replicas * point.requests_per_s),
        seat_wait_p99_s=seat_wait_quantile_s(point, replicas, target_requests_per_s, 0.99)
        if replicas
        else 0.0,
    )
