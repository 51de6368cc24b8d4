"""Cold start: a real one in a fresh process, decomposed; the warm-pool simulation against a
tick-by-tick replay that shares none of its code (integer times, so both are exact)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab.cold_start import (
    PHASES,
    cold_start_from_stamps,
    measure_cold_start,
    simulate_warm_pool,
)


def test_a_cold_start_decomposes_into_positive_phases_that_sum_to_the_total():
    result = measure_cold_start(max_model_len=128, max_num_seqs=2)
    phases = result.phases()
    assert list(phases) == list(PHASES)
    assert all(seconds > 0 for seconds in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(result.total, rel=1e-9)
    assert result.warm_request > 0


def test_phases_from_stamps_by_hand():
    stamps = {
        "start": 10.5,
        "torch": 12.0,
        "minillm": 12.5,
        "engine": 14.0,
        "first": 14.25,
        "second": 14.3,
        "spans": {"load_weights": [[12.6, 13.4]], "allocate_kv": [[13.5, 13.6]]},
    }
    r = cold_start_from_stamps(10.0, stamps)
    assert r.process == pytest.approx(0.5)
    assert r.import_torch == pytest.approx(1.5)
    assert r.import_minillm == pytest.approx(0.5)
    assert r.load_weights == pytest.approx(0.8)
    assert r.allocate_kv == pytest.approx(0.1)
    assert r.engine_other == pytest.approx(1.5 - 0.8 - 0.1)
    assert r.first_request == pytest.approx(0.25)
    assert r.total == pytest.approx(4.25)
    assert r.warm_request == pytest.approx(0.05)


def replay(arrivals, services, warm, cold, max_replicas, slots=1):
    """Brute force: every tick, free slots take the queue's head first, then arrivals in
    order; an arrival that finds the queue non-empty or no slot free launches a replica.
    Returns the waits, the replicas launched and the replica-seconds paid for."""
    started = [0] * warm  # when each replica was launched
    ready = [0] * warm  # when each replica is up
    busy = [[0] * slots for _ in range(warm)]  # when each of its slots finishes
    queue: deque[int] = deque()
    waits = [None] * len(arrivals)
    horizon = (max(arrivals) if arrivals else 0) + sum(services) + cold + 1

    def free(t):
        return [(r, k) for r in range(len(ready)) for k in range(slots)
                if ready[r] <= t and busy[r][k] <= t]  # fmt: skip

    def take(t, i):
        r, k = free(t)[0]
        waits[i] = t - arrivals[i]
        busy[r][k] = t + services[i]

    def serve(t):
        while queue and free(t):
            take(t, queue.popleft())

    j = 0
    for t in range(horizon + 1):
        serve(t)
        while j < len(arrivals) and arrivals[j] == t:
            if not queue and free(t):
                take(t, j)
            else:
                if max_replicas is None or len(ready) < max_replicas:
                    started.append(t)
                    ready.append(t + cold)
                    busy.append([0] * slots)
                queue.append(j)
                serve(t)
            j += 1
    end = max((w + a + s for w, a, s in zip(waits, arrivals, services, strict=True)), default=0)
    paid = sum(end - s for s in started) if arrivals else 0
    return waits, len(ready) - warm, paid


@given(
    arrivals=st.lists(st.integers(0, 40), max_size=25).map(sorted),
    service=st.integers(0, 12),
    jitter=st.lists(st.integers(0, 6), min_size=25, max_size=25),
    warm=st.integers(0, 4),
    cold=st.integers(0, 15),
    cap=st.one_of(st.none(), st.integers(0, 3)),
    slots=st.integers(1, 3),
)
def test_warm_pool_waits_equal_a_tick_by_tick_replay(
    arrivals, service, jitter, warm, cold, cap, slots
):
    services = [service + jitter[i] for i in range(len(arrivals))]
    max_replicas = None if cap is None else max(1, warm) + cap
    run = simulate_warm_pool(
        arrivals,
        services,
        warm_replicas=warm,
        cold_start_s=cold,
        max_replicas=max_replicas,
        slots_per_replica=slots,
    )
    waits, launched, paid = replay(arrivals, services, warm, cold, max_replicas, slots)
    assert list(run.waits_s) == waits
    assert run.launched == launched
    assert run.replica_s == pytest.approx(paid)


def test_a_cap_bounds_the_fleet_a_burst_launches():
    # ten requests at once, 10 s each, 60 s cold start: without a cap each launches a
    # replica (10 replicas x 70 s paid); with a cap of 2 the waits queue behind 2 replicas,
    # and 2 slots a replica halve the fleet again
    arrivals = [0.0] * 10
    free_for_all = simulate_warm_pool(arrivals, 10.0, warm_replicas=0, cold_start_s=60.0)
    assert free_for_all.launched == 10 and free_for_all.replica_s == 10 * 70.0
    capped = simulate_warm_pool(arrivals, 10.0, warm_replicas=0, cold_start_s=60, max_replicas=2)
    assert capped.waits_s == (60, 60, 70, 70, 80, 80, 90, 90, 100, 100)
    assert capped.launched == 2 and capped.replica_s == 2 * 110.0
    wide = simulate_warm_pool(
        arrivals, 10.0, warm_replicas=0, cold_start_s=60, max_replicas=2, slots_per_replica=5
    )
    assert wide.waits_s == (60,) * 10 and wide.replica_s == 2 * 70.0
    with pytest.raises(ValueError, match="slots_per_replica"):
        simulate_warm_pool(arrivals, 1.0, warm_replicas=0, cold_start_s=1, slots_per_replica=0)


def test_a_big_enough_pool_never_waits_and_an_empty_one_waits_a_cold_start():
    arrivals = [0, 1, 2, 3, 10, 11]
    warm = simulate_warm_pool(arrivals, 5.0, warm_replicas=4, cold_start_s=30.0)
    assert warm.waits_s == (0,) * 6 and warm.launched == 0
    cold = simulate_warm_pool(arrivals, 5.0, warm_replicas=0, cold_start_s=30.0)
    # t=0 launches A (up at 30, busy 30-35); t=1, 2, 3 launch B, C, D (busy 31-36, 32-37,
    # 33-38); t=10 finds none free and launches E (up at 40), but A frees first: it starts
    # at 35 (waits 25); t=11 launches F (up at 41) and gets B at 36 (waits 25)
    assert cold.waits_s == (30.0, 30.0, 30.0, 30.0, 25.0, 25.0) and cold.launched == 6
    assert (cold.percentile(50), cold.percentile(99)) == (30.0, 30.0)
    assert cold.mean_wait_s == pytest.approx((4 * 30 + 2 * 25) / 6)
    with pytest.raises(ValueError, match="sorted"):
        simulate_warm_pool([2, 1], 1.0, warm_replicas=1, cold_start_s=1.0)
