"""The replica model's signals against the M/D/infinity queue and against overload."""

import math

import pytest

from minillm.lab.autoscale import simulate_replica


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
