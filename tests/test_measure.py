"""Measuring this machine: the stopwatch, the work counted, and the measured spec."""

import time

import pytest
import torch

from minillm.lab import measure


def test_best_time_is_the_fastest_run_after_a_warm_up():
    durations = iter([0.05, 0.03, 0.01, 0.02])  # the first call is the warm-up
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(durations))

    best = measure.best_time_s(fn, repeats=3, device=torch.device("cpu"))
    assert len(calls) == 4
    assert 0.01 <= best < 0.02


def test_best_time_needs_a_run():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        measure.best_time_s(lambda: None, repeats=0, device=torch.device("cpu"))


def test_gemm_work_is_counted_from_the_shapes():
    run = measure.measure_gemm(8, 16, 32, "cpu", "float32", repeats=1)
    assert run.flops == 2 * 8 * 16 * 32
    assert run.num_bytes == 4 * (8 * 16 + 16 * 32 + 8 * 32)
    assert run.seconds > 0 and run.flops_per_s == run.flops / run.seconds
    assert run.intensity == run.flops / run.num_bytes
    assert run.what == "matmul [8, 16] x [16, 32] float32"


def test_matmul_peak_is_the_best_size():
    run = measure.measure_matmul_flops("cpu", sizes=(32, 64), repeats=1)
    assert run.flops in (2 * 32**3, 2 * 64**3)


def test_read_counts_the_buffer_once_and_copy_twice():
    read = measure.measure_memory_bandwidth("cpu", num_bytes=1 << 20, op="read", repeats=1)
    copy = measure.measure_memory_bandwidth("cpu", num_bytes=1 << 20, op="copy", repeats=1)
    assert read.num_bytes == 1 << 20
    assert copy.num_bytes == 2 << 20
    assert read.flops == 0 and read.bytes_per_s > 0
    with pytest.raises(ValueError, match="'read' or 'copy'"):
        measure.measure_memory_bandwidth("cpu", num_bytes=1 << 20, op="write", repeats=1)


def test_devices_other_than_cpu_and_cuda_are_refused():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        measure.resolve_device("meta")


@pytest.mark.slow
def test_this_machine_is_a_measured_spec():
    spec = measure.this_machine()
    assert spec is measure.this_machine()  # measured once per process
    assert spec.measured and spec.name.startswith("this machine (")
    assert spec.sparse_flops_per_s == {}
    assert spec.peak_flops("float32") > 1e8  # any computer of this century
    assert spec.memory_bandwidth_bytes_per_s > 1e8
    assert spec.num_compute_units >= 1 and spec.memory_bytes > 1e8


def test_a_cpu_measures_float32():
    assert measure.default_matmul_dtype("cpu") == "float32"


def test_op_time_counts_one_read_and_one_write_per_element():
    run = measure.measure_op_time(1000, "cpu", ops_per_run=4, repeats=2)
    assert run.num_bytes == 8000 and run.flops == 1000
    assert 0 < run.seconds < 0.1
    assert run.what == "add of 1000 float32"


def test_op_time_divides_the_run_by_its_operations(monkeypatch):
    calls = []
    monkeypatch.setattr(measure, "best_time_s", lambda fn, repeats, dev: calls.append(fn) or 0.5)
    assert measure.measure_op_time(10, "cpu", ops_per_run=50).seconds == 0.01
    before = len(calls)
    with pytest.raises(ValueError, match="num_elements must be >= 1"):
        measure.measure_op_time(0, "cpu")
    with pytest.raises(ValueError, match="ops_per_run must be >= 1"):
        measure.measure_op_time(10, "cpu", ops_per_run=0)
    assert len(calls) == before
