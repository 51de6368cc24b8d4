"""Number formats from their bit layouts, against PyTorch's own dtypes and the OCP FP4 table."""

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from minillm.model.quantization.formats import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    FORMATS,
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    INT4,
    INT8,
    format_table,
)

TORCH_FORMATS = [FLOAT32, BFLOAT16, FLOAT16, FP8_E4M3, FP8_E5M2]


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.name)
def test_range_and_precision_match_torch_finfo(fmt):
    info = torch.finfo(fmt.torch_dtype)
    assert fmt.bits == info.bits
    assert fmt.max == info.max
    assert fmt.min_normal == info.smallest_normal
    assert fmt.machine_epsilon == info.eps
    assert fmt.unit_roundoff == info.eps / 2


def test_known_values():
    assert (FP8_E4M3.max, FP8_E5M2.max, FLOAT16.max, FP4_E2M1.max) == (448, 57344, 65504, 6)
    assert FP8_E4M3.min_subnormal == 2.0**-9 and FLOAT16.min_subnormal == 2.0**-24
    assert BFLOAT16.unit_roundoff == 2.0**-8 and FLOAT16.unit_roundoff == 2.0**-11


@pytest.mark.parametrize("fmt", [FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
def test_every_fp8_code_decodes_like_torch(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(fmt.torch_dtype).float().tolist()
    for code, value in zip(range(256), expected, strict=True):
        ours = fmt.decode(code)
        assert (math.isnan(ours) and math.isnan(value)) or ours == value, code


def test_fp4_e2m1_holds_the_ocp_values():
    positive = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert FP4_E2M1.values() == sorted({-v for v in positive} | set(positive))
    assert not any(math.isnan(FP4_E2M1.decode(c)) for c in range(16))


@given(
    mantissa=st.floats(1.0, 2.0, exclude_max=True),
    exponent=st.integers(-14, 15),
    fmt=st.sampled_from([BFLOAT16, FLOAT16, FP8_E4M3, FP8_E5M2]),
)
def test_rounding_error_is_at_most_the_unit_roundoff(mantissa, exponent, fmt):
    x = mantissa * 2.0**exponent
    assume(fmt.min_normal <= x <= fmt.max)
    stored = torch.tensor(x, dtype=torch.float64).to(fmt.torch_dtype).double().item()
    assert abs(stored - x) / x <= fmt.unit_roundoff


def test_integer_ranges_and_table():
    assert INT8.signed_range == (-127, 127) and INT8.unsigned_range == (0, 255)
    assert INT4.signed_range == (-7, 7) and INT4.levels == 16
    rows = {row["format"]: row for row in format_table()}
    assert set(rows) == set(FORMATS)
    assert rows["fp8_e4m3"]["max"] == 448 and rows["int4"]["max"] == 7


def test_bad_code_is_refused():
    with pytest.raises(ValueError, match="code must be"):
        FP8_E4M3.decode(256)
    with pytest.raises(ValueError, match="16 bits or fewer"):
        FLOAT32.values()
