"""Offload versus recompute: the PCIe and FLOP arithmetic."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab import kv_offload, roofline
from minillm.lab.catalog import get_model_config
from minillm.lab.hardware import get_device
from minillm.lab.units import GB


def test_pcie_rates():
    # 16 GT/s * 16 lanes * 128/130 / 8 bits = 31.5 GB/s; Gen5 doubles it
    assert math.isclose(kv_offload.pcie_bandwidth_bytes_per_s(4), 31.5076923e9, rel_tol=1e-6)
    assert math.isclose(kv_offload.pcie_bandwidth_bytes_per_s(5), 63.0153846e9, rel_tol=1e-6)
    assert kv_offload.pcie_bandwidth_bytes_per_s(5, 8) == kv_offload.pcie_bandwidth_bytes_per_s(4)
    with pytest.raises(ValueError):
        kv_offload.pcie_bandwidth_bytes_per_s(7)


def test_8k_llama_prefix_fetch_versus_recompute():
    # 8192 tokens of 128 KiB over 50 GB/s: 1.07 GB, 21.5 ms
    fetch = kv_offload.kv_fetch_time_s(8192, 131_072, 50 * GB)
    assert math.isclose(fetch, 8192 * 131_072 / 50e9)
    assert 0.021 < fetch < 0.022
    config = get_model_config("Llama 3.1 8B")
    h100 = get_device("H100 SXM")
    flops = kv_offload.recompute_flops(config, 8192)
    assert flops == roofline.prefill_cost(config, 8192).flops
    # about 2 * 8e9 params * 8192 tokens plus attention
    assert 2 * 7e9 * 8192 < flops < 2 * 9e9 * 8192 * 1.3
    recompute = kv_offload.recompute_time_s(config, 8192, h100.peak_flops("bfloat16"), 0.5)
    assert math.isclose(recompute, flops / (0.5 * h100.peak_flops("bfloat16")))
    assert recompute > 10 * fetch


def test_break_even_bandwidth():
    # 100 bytes and 1000 FLOPs per token at 1e12 FLOP/s: 1e-9 s per token, so 100 GB/s
    assert math.isclose(kv_offload.break_even_bandwidth_bytes_per_s(100, 1000, 1e12), 100e9)


@given(
    st.integers(1, 100_000),
    st.floats(1e3, 1e7),
    st.floats(1e6, 1e12),
    st.floats(1e11, 1e16),
)
def test_at_break_even_fetch_and_recompute_take_equal_time(n, b, f, s):
    bw = kv_offload.break_even_bandwidth_bytes_per_s(b, f, s)
    fetch = kv_offload.kv_fetch_time_s(n, b, bw)
    assert math.isclose(fetch, n * f / s, rel_tol=1e-9)
    # a faster link fetches sooner than recompute, a slower one later
    assert kv_offload.kv_fetch_time_s(n, b, 2 * bw) < n * f / s
    assert kv_offload.kv_fetch_time_s(n, b, bw / 2) > n * f / s


def test_bad_inputs():
    with pytest.raises(ValueError):
        kv_offload.kv_fetch_time_s(10, 10, 0)
    with pytest.raises(ValueError):
        kv_offload.recompute_time_s(get_model_config("Qwen3-0.6B"), 10, 1e12, 0)
    with pytest.raises(ValueError):
        kv_offload.break_even_bandwidth_bytes_per_s(0, 1, 1)


def test_measured_fetch_bandwidth_is_plausible():
    bw = kv_offload.measure_fetch_bandwidth_bytes_per_s(8 * 2**20, "cpu", repeats=2)
    # a memcpy on any machine this runs on: between 100 MB/s and 1 TB/s
    assert 1e8 < bw < 1e12
    with pytest.raises(ValueError):
        kv_offload.measure_fetch_bandwidth_bytes_per_s(0)


def test_a_copy_achieves_less_than_the_raw_link_rate():
    # raw Gen5 x16: 32 GT/s x 16 lanes x 128/130 / 8 = 63.0 GB/s; a pinned copy reaches
    # about 50 GB/s, Gen4 about 25 GB/s (CUDA's bandwidthTest on such links)
    assert kv_offload.pcie_bandwidth_bytes_per_s(5) == pytest.approx(32e9 * 16 * 128 / 130 / 8)
    assert kv_offload.pcie_copy_bandwidth_bytes_per_s(5) == pytest.approx(50.4e9, rel=1e-3)
    assert kv_offload.pcie_copy_bandwidth_bytes_per_s(4) == pytest.approx(25.2e9, rel=1e-3)
    assert kv_offload.pcie_copy_bandwidth_bytes_per_s(4, lanes=8) == pytest.approx(12.6e9, rel=1e-3)


def test_a_swap_moves_the_kv_out_and_back():
    # 1000 tokens of 128 KiB at 50 GB/s: 2.62 ms each way
    one_way = 1000 * 131072 / 50e9
    assert kv_offload.swap_time_s(1000, 131072, 50e9) == pytest.approx(2 * one_way)
    assert kv_offload.swap_time_s(0, 131072, 50e9) == 0
