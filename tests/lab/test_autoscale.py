"""The replica model's signals against the M/D/infinity queue and against overload."""

import math

import numpy as np
import pytest

from minillm.lab.autoscale import (
    desired_replicas,
    fleet_after_sync,
    simulate_replica,
    simulate_scaler,
)


@pytest.mark.parametrize("rate, service", [(0.25, 2.0), (0.5, 2.0), (1.0, 1.0)])
def test_below_capacity_it_is_an_infinite_server_queue(rate, service):
    # max_running far above rate * service: nobody waits, the number running is Poisson
    signals = simulate_replica(rate, service, 64, seconds=4000.0, dt=0.05, seed=1)
    mean_running = rate * service
    assert signals.queue == 0.0
    assert signals.utilization == pytest.approx(1 - math.exp(-mean_running), abs=0.03)
    assert signals.kv_usage * 64 == pytest.approx(mean_running, rel=0.08)


def test_utilization_saturates_while_queue_and_kv_tell_the_load():
    light = simulate_replica(1.0, 4.0, 16, seconds=600.0)
    overloaded = simulate_replica(4.4, 4.0, 16, seconds=600.0)
    assert light.utilization > 0.95 and overloaded.utilization > 0.99
    assert light.kv_usage < 0.35 < 0.95 < overloaded.kv_usage
    assert light.queue == 0.0 and overloaded.queue > 10 * 16 * 0.1


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_running"):
        simulate_replica(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="service_s"):
        simulate_replica(1.0, 0.0, 4)


def ramp(t: float) -> float:
    """2 requests/s for 300 s, then up to 6 over the next 300 s."""
    return 2.0 if t < 300 else min(6.0, 2 + 4 * (t - 300) / 300)


def scaled(target: float, **kwargs):
    args = dict(seconds=1200, service_s=20, seats=16, cold_start_s=60, initial_replicas=3)
    return simulate_scaler(ramp, target_usage=target, **(args | kwargs))


def test_a_launch_takes_traffic_one_cold_start_later():
    trace = scaled(0.8)
    first = int(np.argmax(trace.starting > 0))  # the first launch
    assert trace.t_s[first] % 15 == 0  # decided at a sync
    up = int(np.argmax(trace.ready > trace.ready[first]))
    assert trace.t_s[up] - trace.t_s[first] == pytest.approx(60)
    # the fleet follows the load up, never past the cap
    assert trace.ready[-1] >= math.ceil(6 * 20 / 16)
    capped = scaled(0.8, max_replicas=5)
    assert (capped.ready + capped.starting).max() == 5


def test_headroom_for_the_lead_time_keeps_the_queue_short():
    # seat demand grows by 4 / 300 * 20 = 0.27 seats a second; over one cold start and one
    # sync (75 s) that is 20 seats, so at 40 busy seats the spare must be 20: a target of
    # 40 / 60 = 0.67. At 0.95 (2 spare seats) requests wait at p99 for most of a cold start.
    tight, planned = scaled(0.95), scaled(0.6)

    def p99(trace):  # past the empty fleet's first fill
        return np.quantile(trace.waits_s[trace.arrived_s >= 120], 0.99)

    assert p99(planned) < 0.4 * p99(tight)
    assert len(tight.arrived_s) == len(tight.waits_s) and np.all(np.diff(tight.arrived_s) >= 0)
    assert planned.queue.max() < 0.4 * tight.queue.max()
    assert planned.replica_s > tight.replica_s  # headroom is paid for


def test_the_stabilization_window_stops_flapping():
    # a steady load near a boundary: without a window the replica count follows the noise
    def changes(trace):
        fleet = trace.ready + trace.starting
        return int(np.count_nonzero(np.diff(fleet)))

    steady = dict(seconds=1500, service_s=20, seats=16, cold_start_s=60, initial_replicas=4)
    calm = simulate_scaler(lambda t: 3.0, target_usage=0.9, **steady)
    jumpy = simulate_scaler(lambda t: 3.0, target_usage=0.9, scale_down_window_s=0, **steady)
    assert changes(jumpy) > 3 * max(1, changes(calm))


def test_bad_scaler_arguments():
    with pytest.raises(ValueError, match="target_usage"):
        scaled(1.5)
    with pytest.raises(ValueError, match="initial_replicas"):
        scaled(0.8, initial_replicas=0)


def test_one_sync_by_hand():
    # 100 requests on 16-seat replicas at 80%: 100 / 12.8 = 7.8 -> 8 replicas
    assert desired_replicas(100, 16, 0.8, 64) == 8
    assert desired_replicas(0, 16, 0.8, 64) == 1 and desired_replicas(10_000, 16, 0.8, 64) == 64
    assert fleet_after_sync(5, 100, 16, 0.8, [], 64) == 8  # up at once
    assert fleet_after_sync(10, 100, 16, 0.8, [9, 7], 64) == 9  # down to the window's largest
    assert fleet_after_sync(10, 100, 16, 0.8, [12], 64) == 10  # the window never adds
    assert fleet_after_sync(10, 100, 16, 0.8, [], 64) == 8  # no window: straight down
