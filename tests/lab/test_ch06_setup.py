"""The numbers the second page of chapter 6 quotes, against independent sources: torch.finfo
for the formats, the OCP and NVIDIA block layouts by hand, and a scan of the roofline floors
for the W4A16 crossover."""

from __future__ import annotations

import pytest
import torch

from minillm.lab import ch06_setup, numerics
from minillm.lab.catalog import get_model_config
from minillm.lab.hardware import get_device


def test_format_facts_match_torch_finfo():
    facts = ch06_setup.format_facts()
    assert facts["fp16_max"] == torch.finfo(torch.float16).max == 65504.0
    assert facts["e4m3_max"] == torch.finfo(torch.float8_e4m3fn).max == 448.0
    assert facts["e5m2_max"] == torch.finfo(torch.float8_e5m2).max == 57344.0
    # E4M3's smallest subnormal is 2^-9 (bias 7, 3 mantissa bits)
    assert facts["e4m3_half_sub"] == 2.0**-10


def test_block_format_bits_per_element():
    facts = ch06_setup.format_facts()
    assert facts["mxfp4_bits"] == pytest.approx(4 + 8 / 32)  # E2M1 plus an E8M0 per 32
    assert facts["nvfp4_bits"] == pytest.approx(4 + 8 / 16)  # E2M1 plus an E4M3 per 16


def test_w4a16_crossover_by_scanning_the_floors():
    b4, b16 = ch06_setup.w4a16_crossover_batches()
    config, device = get_model_config("Llama 3.1 8B"), get_device("H100 SXM")
    n, k = config.intermediate_size, config.hidden_size
    peak = device.peak_flops("bfloat16")

    def compute_bound(m: int, scheme: str) -> bool:
        flops_s = 2 * m * n * k / peak
        return numerics.linear_floor_s(m, n, k, device, scheme) == pytest.approx(flops_s, rel=1e-12)

    assert 1 < b4 < b16
    # from b16 on, W4A16 is no faster than bfloat16; just below it, it still is
    assert numerics.linear_floor_s(b16, n, k, device, "w4a16") == pytest.approx(
        numerics.linear_floor_s(b16, n, k, device), rel=1e-9
    )
    assert numerics.linear_floor_s(b16 - 1, n, k, device, "w4a16") < numerics.linear_floor_s(
        b16 - 1, n, k, device
    )
    assert compute_bound(b4, "w4a16") and not compute_bound(b4 - 1, "w4a16")


def test_formula_points_stay_at_most_a_third_of_the_chapter():
    """The exercise list the page glues: 14 graded cells, and the five that apply a stated
    formula or API hold at most a third of the points."""
    path = ch06_setup.__file__.rsplit("/minillm/", 1)[0] + "/exercises/ch06_quantization.ipynb"
    points = ch06_setup.exercise_points(path)
    assert points == [3, 2, 3, 5, 3, 3, 3, 3, 2, 2, 3, 2, 5, 4]
    assert ch06_setup.FORMULA_EXERCISES == (1, 2, 5, 9, 11)
    formula = ch06_setup.formula_points(points)
    assert formula == 3 + 2 + 3 + 2 + 3 == 13
    assert 3 * formula <= sum(points) == 43
