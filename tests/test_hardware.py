"""The accelerator spec table: datasheet values, dense versus sparse, and lookups."""

import pytest

from minillm.lab import hardware
from minillm.lab.hardware import DEVICES, compute_format, get_device

# (device, dense bf16-or-fp16 TFLOP/s, bandwidth TB/s, memory "GB") as printed by the vendors;
# the memory label is binary: an "80 GB" board holds 80 GiB.
DATASHEET = [
    ("H100 SXM", "bfloat16", 989.4, 3.35, 80),
    ("H200 SXM", "bfloat16", 989.4, 4.8, 141),
    ("A100 SXM 80GB", "bfloat16", 312, 2.039, 80),
    ("L40S", "bfloat16", 362.05, 0.864, 48),
    ("L4", "bfloat16", 121, 0.300, 24),
    ("T4", "float16", 65, 0.320, 16),
    ("RTX 4090", "bfloat16", 165.2, 1.008, 24),
    ("MI300X", "bfloat16", 1307.4, 5.3, 192),
    ("TPU v5e", "bfloat16", 197, 0.819, 16),
]


@pytest.mark.parametrize("name, dtype, tflops, tb_per_s, gb", DATASHEET)
def test_datasheet_values(name, dtype, tflops, tb_per_s, gb):
    spec = get_device(name)
    assert spec.peak_flops(dtype) == pytest.approx(tflops * 1e12, rel=1e-12)
    assert spec.memory_bandwidth_bytes_per_s == pytest.approx(tb_per_s * 1e12, rel=1e-12)
    assert spec.memory_bytes == gb * 2**30
    assert not spec.measured
    assert spec.source.strip() and len(spec.source_date) == 7


def test_the_table_holds_the_devices_the_book_uses():
    assert set(DEVICES) == {name for name, *_ in DATASHEET}
    assert hardware.device_names() == list(DEVICES)
    with pytest.raises(ValueError, match="unknown device"):
        hardware.get_device("this machine")  # measured by minillm.lab.measure, not a datasheet


@pytest.mark.parametrize(
    "name, sm_count, flop_per_clock_per_unit, boost_ghz",
    [
        # dense bf16: units x FLOP per clock per unit x boost clock (vendor architecture docs)
        ("H100 SXM", 132, 4096, 1.830),  # 1024 FMA/clock per SM, 4th-gen tensor cores
        ("A100 SXM 80GB", 108, 2048, 1.410),  # 512 FMA/clock per SM, 3rd-gen tensor cores
        ("MI300X", 304, 2048, 2.100),  # 1024 FMA/clock per CU
    ],
)
def test_dense_peak_is_units_times_rate_times_clock(
    name, sm_count, flop_per_clock_per_unit, boost_ghz
):
    spec = get_device(name)
    assert spec.num_compute_units == sm_count
    expected = sm_count * flop_per_clock_per_unit * boost_ghz * 1e9
    assert spec.peak_flops("bf16") == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(
    "name, stacks, gbit_per_pin",
    [("H100 SXM", 5, 5.23), ("A100 SXM 80GB", 5, 3.186), ("MI300X", 8, 5.2)],
)
def test_hbm_bandwidth_is_stacks_times_1024_pins_times_rate(name, stacks, gbit_per_pin):
    expected = stacks * 1024 * gbit_per_pin * 1e9 / 8  # bits -> bytes
    assert get_device(name).memory_bandwidth_bytes_per_s == pytest.approx(expected, rel=5e-3)


@pytest.mark.parametrize("name", list(DEVICES))
def test_sparse_figures_are_twice_dense_and_kept_apart(name):
    spec = get_device(name)
    for fmt, sparse in spec.sparse_flops_per_s.items():
        # the L40S datasheet prints 362.05 dense and 733 sparse: 1.2% off exactly twice
        assert sparse == pytest.approx(2 * spec.peak_flops(fmt), rel=1.5e-2)
        assert spec.sparse_peak_flops(fmt) == sparse
        assert spec.peak_flops(fmt) < sparse


def test_l40s_dense_is_the_number_without_the_asterisk():
    spec = get_device("L40S")
    assert spec.peak_flops("bfloat16") == pytest.approx(362.05e12)
    assert spec.sparse_peak_flops("bfloat16") == pytest.approx(733e12)


def test_t4_has_no_bfloat16_and_no_sparsity():
    t4 = get_device("T4")
    assert not t4.supports("bfloat16") and t4.supports("fp16")
    with pytest.raises(ValueError, match="T4 lists no bfloat16 peak"):
        t4.peak_flops("bfloat16")
    with pytest.raises(ValueError, match="no sparse"):
        t4.sparse_peak_flops("float16")


def test_a100_has_no_fp8():
    with pytest.raises(ValueError, match="no fp8"):
        get_device("A100 SXM 80GB").peak_flops("fp8_e4m3")


@pytest.mark.parametrize("name", list(DEVICES))
def test_faster_formats_are_never_slower(name):
    spec = get_device(name)
    order = ["float32", "tf32", "bfloat16", "fp8"]
    peaks = [spec.peak_flops_per_s[f] for f in order if f in spec.peak_flops_per_s]
    assert peaks == sorted(peaks)


def test_hopper_parts_share_compute_but_not_memory():
    h100, h200 = get_device("H100 SXM"), get_device("H200 SXM")
    assert dict(h100.peak_flops_per_s) == dict(h200.peak_flops_per_s)
    assert h200.memory_bandwidth_bytes_per_s > h100.memory_bandwidth_bytes_per_s
    # chapter 2's ratio: 4.8 TB/s against 3.35 TB/s (NVIDIA's H200 and H100 SXM datasheets),
    # 1.43x, not the "twice" often quoted
    ratio = h200.memory_bandwidth_bytes_per_s / h100.memory_bandwidth_bytes_per_s
    assert ratio == pytest.approx(4.8 / 3.35) and round(ratio, 2) == 1.43


def test_spec_tables_are_read_only():
    with pytest.raises(TypeError):
        get_device("H100 SXM").peak_flops_per_s["bfloat16"] = 1.0
    with pytest.raises(TypeError):
        DEVICES["mine"] = DEVICES["L4"]


@pytest.mark.parametrize(
    "alias, fmt",
    [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"), ("fp8_e4m3", "fp8"),
     ("fp8_e5m2", "fp8"), ("int8", "int8"), ("tf32", "tf32")],
)  # fmt: skip
def test_compute_format_aliases(alias, fmt):
    assert compute_format(alias) == fmt


def test_compute_format_accepts_torch_dtypes():
    import torch

    assert compute_format(torch.bfloat16) == "bfloat16"
    assert compute_format(torch.float8_e4m3fn) == "fp8"


@pytest.mark.parametrize("bad", ["int4", "float64", "BF16", ""])
def test_unknown_compute_format_is_an_error(bad):
    with pytest.raises(ValueError, match="no compute format"):
        compute_format(bad)


def test_lookup_is_case_insensitive_and_names_the_choices():
    assert get_device("h100 sxm") is DEVICES["H100 SXM"]
    with pytest.raises(ValueError, match=r"unknown device 'B300'.*H100 SXM"):
        get_device("B300")


@pytest.mark.parametrize(
    "name, reported_gib",
    # torch.cuda.get_device_properties(0).total_memory as the driver reports it
    [("H100 SXM", 79.18), ("A100 SXM 80GB", 79.15), ("T4", 14.75)],
)
def test_runtime_memory_is_what_cuda_reports(name, reported_gib):
    spec = get_device(name)
    assert spec.runtime_memory_bytes() == pytest.approx(reported_gib * 2**30, rel=1e-12)
    # the driver keeps a few percent of the board's memory, never more than 10%
    assert 0.9 * spec.memory_bytes < spec.runtime_memory_bytes() < spec.memory_bytes


def test_runtime_memory_without_a_recorded_figure_is_the_boards():
    spec = get_device("H200 SXM")
    assert spec.cuda_memory_bytes is None
    assert spec.runtime_memory_bytes() == 141 * 2**30
