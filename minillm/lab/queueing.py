"""Waiting for a seat: the M/M/c queue (Erlang C) and a discrete-event simulation of the
same queue that also takes bursty arrivals and fixed holding times.

A replica that runs up to `c` requests at a time is a `c`-server queue: a request holds a
seat (a batch slot) for its whole life, and a request that arrives with every seat taken
waits, first come first served. With Poisson arrivals at rate `lam`, holding times with
mean `hold_s` and the offered load `a = lam * hold_s` (Erlangs, the mean number of busy
seats by Little's law; the utilization is `a / c`):

    Erlang B   B(0, a) = 1,  B(k, a) = a B(k-1, a) / (k + a B(k-1, a))
    Erlang C   C(c, a) = c B(c, a) / (c - a (1 - B(c, a)))     P(a request waits)

and with exponential holding times the wait is 0 with probability 1 - C and otherwise
exponential with rate `(c - a) / hold_s`, so

    P(W > t) = C exp(-(c - a) t / hold_s),   W_q = hold_s ln(C / (1 - q)) / (c - a)

(Erlang 1917; any queueing text, e.g. Harchol-Balter, "Performance Modeling and Design of
Computer Systems", ch. 14). The recursion avoids the factorials of the textbook formula,
which overflow floats at the hundreds of seats an LLM replica has.

`simulate_waits` runs the same queue event by event (Kiefer-Wolfowitz: each arrival takes
the seat that frees first) for any arrival times and holding times, so it checks the
formula where the formula holds and answers where it does not: fixed holding times (every
request the same length) and bursty arrivals.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np


def _check_load(servers: int, load_erlangs: float) -> None:
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if not 0 <= load_erlangs < servers:
        raise ValueError(
            f"the load must be in [0, servers) for a stable queue, got {load_erlangs} Erlangs "
            f"on {servers} servers"
        )


def erlang_c(servers: int, load_erlangs: float) -> float:
    """P(an arrival waits) in an M/M/c queue with `servers` seats and `load_erlangs`
    offered load (arrival rate times mean holding time)."""
    _check_load(servers, load_erlangs)
    b = 1.0
    for k in range(1, servers + 1):
        b = load_erlangs * b / (k + load_erlangs * b)
    return servers * b / (servers - load_erlangs * (1 - b))


def wait_quantile_s(servers: int, load_erlangs: float, hold_s: float, q: float) -> float:
    """The q-quantile of the wait for a seat in an M/M/c queue (seconds; 0 when fewer
    than a fraction 1 - q of the arrivals wait)."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if hold_s <= 0:
        raise ValueError(f"hold_s must be > 0, got {hold_s}")
    p_wait = erlang_c(servers, load_erlangs)
    if p_wait <= 1 - q:
        return 0.0
    return hold_s * math.log(p_wait / (1 - q)) / (servers - load_erlangs)


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` arrival times of a Poisson process at `rate` per second."""
    return np.cumsum(rng.exponential(1 / rate, n))


def gamma_arrivals(rate: float, scv: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` arrival times at mean `rate` whose gaps are Gamma distributed with squared
    coefficient of variation `scv` (1 is Poisson; above 1 the arrivals come in bursts
    separated by long gaps)."""
    if scv <= 0:
        raise ValueError(f"scv must be > 0, got {scv}")
    shape = 1 / scv
    return np.cumsum(rng.gamma(shape, 1 / (rate * shape), n))


def simulate_waits(
    arrivals_s: Sequence[float], holds_s: Sequence[float], servers: int
) -> np.ndarray:
    """The wait for a seat of each request, first come first served on `servers` seats,
    from arrival times (sorted) and each request's holding time."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if len(arrivals_s) != len(holds_s):
        raise ValueError("expected one holding time per arrival")
    free_at = [0.0] * servers  # when each seat frees; a heap, the earliest first
    waits = np.empty(len(arrivals_s))
    last = -math.inf
    for i, (t, hold) in enumerate(zip(arrivals_s, holds_s, strict=True)):
        if t < last:
            raise ValueError("arrival times must be sorted")
        last = t
        start = max(t, free_at[0])
        waits[i] = start - t
        heapq.heapreplace(free_at, start + hold)
    return waits
