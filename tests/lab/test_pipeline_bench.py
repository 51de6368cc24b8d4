"""The pipeline bench's verdict: a measured bubble within 20% of a formula, relative to it."""

from __future__ import annotations

import pytest

from minillm.lab.pipeline_bench import verdict, within


@pytest.mark.parametrize(
    ("measured", "formula", "expected"),
    [
        (0.11, 0.1, True),
        (0.09, 0.1, True),
        # 0.024 off: within 20% of the measured 0.124, not of the formula's 0.1
        (0.124, 0.1, False),
        (0.076, 0.1, False),
        # an absolute 0.2 would take this; relative to the formula it is 8 times over
        (0.118, 0.014, False),
    ],
)
def test_within_is_relative_to_the_formula(measured, formula, expected):
    assert within({"bubble_median": measured, "formula": formula}, "formula") is expected


def test_verdict_names_both_formulas():
    r = {"bubble_median": 0.259, "formula": 0.014, "formula_uneven_median": 0.230}
    assert verdict(r) == (
        "bubble 0.259 against 0.014 for equal stages (not within 20%) and 0.230 for the "
        "stages as measured (within 20%)"
    )
