"""Units: bytes per dtype, weight bytes, GB vs GiB, formatting, token rates."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.lab import units

# Bits per element from the formats' definitions, independent of the module's table.
BITS = {
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int8": 8,
    "int4": 4,
    "fp4": 4,
}


def test_dtype_table_matches_bits_over_eight():
    assert dict(units.DTYPE_BYTES) == {name: bits / 8 for name, bits in BITS.items()}


def test_dtype_table_is_read_only():
    with pytest.raises(TypeError):
        units.DTYPE_BYTES["float64"] = 8


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.float32, 4),
        (torch.float, 4),
        (torch.bfloat16, 2),
        (torch.float16, 2),
        (torch.half, 2),
        (torch.int8, 1),
        (torch.float8_e4m3fn, 1),
        (torch.float8_e5m2, 1),
        ("bf16", 2),
        ("fp16", 2),
        ("fp32", 4),
        ("int4", 0.5),
        ("fp4", 0.5),
    ],
)
def test_dtype_bytes_accepts_torch_dtypes_and_aliases(dtype, expected):
    assert units.dtype_bytes(dtype) == expected


@pytest.mark.parametrize("bad", ["float64", "int3", "BF16", "", torch.float64, torch.int64])
def test_unknown_dtype_is_a_value_error_naming_the_choices(bad):
    with pytest.raises(ValueError, match=r"unknown dtype .*expected one of: .*bfloat16"):
        units.dtype_bytes(bad)


def test_dtype_bytes_rejects_other_types():
    with pytest.raises(TypeError):
        units.dtype_bytes(16)


def test_weight_bytes_worked_examples():
    # Llama 3.1 8B: 8.03e9 parameters.
    assert units.weight_bytes(8.03e9, "bfloat16") == 16_060_000_000
    assert units.weight_bytes(8_030_000_000, "float32") == 32_120_000_000
    assert units.weight_bytes(8_030_000_000, "int4") == 4_015_000_000
    # Packed formats round up: three 4-bit values need two bytes.
    assert units.weight_bytes(3, "int4") == 2
    assert units.weight_bytes(0, "fp4") == 0


@given(st.integers(min_value=0, max_value=10**15), st.sampled_from(sorted(BITS)))
def test_weight_bytes_is_bits_rounded_up_to_whole_bytes(num_params, dtype):
    got = units.weight_bytes(num_params, dtype)
    assert isinstance(got, int)
    total_bits = num_params * BITS[dtype]
    assert got == -(-total_bits // 8)


@pytest.mark.parametrize("bad", [-1, 2.5, float("nan"), float("inf")])
def test_weight_bytes_rejects_counts_that_are_not_whole(bad):
    with pytest.raises(ValueError, match="whole number"):
        units.weight_bytes(bad, "bfloat16")


@pytest.mark.parametrize("bad", ["8e9", True, None])
def test_weight_bytes_rejects_non_numbers(bad):
    with pytest.raises(TypeError):
        units.weight_bytes(bad, "bfloat16")


def test_gb_and_gib():
    assert units.GB == 1_000_000_000
    assert units.GiB == 1_073_741_824
    assert units.to_gb(16.06e9) == pytest.approx(16.06)
    assert units.to_gib(16.06e9) == pytest.approx(14.957, abs=1e-3)
    assert units.to_gib(24 * 1024**3) == 24
    assert units.GiB / units.GB == pytest.approx(1.0737, abs=1e-4)


@pytest.mark.parametrize(
    "num_bytes, binary, expected",
    [
        (16.06e9, True, "14.96 GiB"),
        (16.06e9, False, "16.06 GB"),
        (0, True, "0 B"),
        (1023, True, "1023 B"),
        (1024, True, "1.00 KiB"),
        (1000, False, "1.00 KB"),
        (1000, True, "1000 B"),
        (3 * 2**20, True, "3.00 MiB"),
        (2.5 * 2**40, True, "2.50 TiB"),
        (2e15, False, "2000.00 TB"),
    ],
)
def test_format_bytes(num_bytes, binary, expected):
    assert units.format_bytes(num_bytes, binary=binary) == expected


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf")])
def test_format_bytes_rejects_negative_and_non_finite(bad):
    with pytest.raises(ValueError):
        units.format_bytes(bad)


def test_token_rates():
    assert units.tokens_per_s(256, 3.2) == pytest.approx(80.0)
    assert units.ms_per_token(256, 3.2) == pytest.approx(12.5)
    assert units.tokens_per_s(0, 1.0) == 0


@given(st.integers(min_value=1, max_value=10**6), st.floats(min_value=1e-3, max_value=1e4))
def test_ms_per_token_is_a_thousand_over_tokens_per_s(num_tokens, duration_s):
    rate = units.tokens_per_s(num_tokens, duration_s)
    assert math.isclose(units.ms_per_token(num_tokens, duration_s), 1000 / rate, rel_tol=1e-12)


@pytest.mark.parametrize("num_tokens, duration_s", [(10, 0.0), (10, -1.0), (-1, 1.0)])
def test_tokens_per_s_rejects_bad_input(num_tokens, duration_s):
    with pytest.raises(ValueError):
        units.tokens_per_s(num_tokens, duration_s)


def test_ms_per_token_needs_a_token():
    with pytest.raises(ValueError):
        units.ms_per_token(0, 1.0)
