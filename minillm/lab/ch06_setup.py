"""What the second page of chapter 6 (quantized models in practice) quotes from the first.

The first page derives the number formats and the roofline of weight-only quantization in
visible cells; the second page's FP8 KV cache section, summary and self-check quote a few of
those numbers. Glue does not cross pages, so these functions recompute them, from the same
definitions, in a fraction of a second.
"""

from __future__ import annotations

from minillm.lab import numerics
from minillm.lab.catalog import get_model_config
from minillm.lab.hardware import get_device

LAYER = 2  # the decoder layer of the bundled model that both pages quantize
GROUP_SIZE = 128  # int4 weights: one scale and zero point per group of 128 inputs


def format_facts() -> dict[str, float]:
    """The format properties the second page quotes, from the bit layouts
    (`numerics.format_row`): the largest values of float16, FP8 E4M3 and E5M2, half of
    E4M3's smallest subnormal (below it a value rounds to zero), and the bits per element of
    MXFP4 and NVFP4, keyed by the first page's glue names."""
    rows = {
        fmt.name: numerics.format_row(fmt)
        for fmt in (numerics.FLOAT16, numerics.FP8_E4M3, numerics.FP8_E5M2)
    }
    return {
        "fp16_max": rows["float16"]["max"],
        "e4m3_max": rows["fp8_e4m3"]["max"],
        "e5m2_max": rows["fp8_e5m2"]["max"],
        "e4m3_half_sub": rows["fp8_e4m3"]["min_subnormal"] / 2,
        "mxfp4_bits": numerics.MXFP4.bits_per_element,
        "nvfp4_bits": numerics.NVFP4.bits_per_element,
    }


def w4a16_crossover_batches(
    model: str = "Llama 3.1 8B", device: str = "H100 SXM"
) -> tuple[int, int]:
    """(b4, b16) of `numerics.w4a16_batches` for the model's MLP up projection (hidden ->
    intermediate) on the device: from b4 the W4A16 layer is compute-bound, from b16 the
    bfloat16 layer too, and W4A16 gains nothing (the first page's roofline figure)."""
    config = get_model_config(model)
    return numerics.w4a16_batches(
        config.intermediate_size, config.hidden_size, get_device(device), GROUP_SIZE
    )


# the exercises that apply a formula or an API the pages state (the others build a mechanism
# or derive a number): per group with a zero point, dequantize, an FP8 scale, SmoothQuant's
# scales, measuring with the engine
FORMULA_EXERCISES = (1, 2, 5, 9, 11)


def exercise_points(path) -> list[int]:
    """The points of each graded cell of a chapter's exercise notebook, in order."""
    from minillm.course.grading import graded_points, read_notebook

    cells = read_notebook(path).cells
    return [
        graded_points(c.source)
        for c in cells
        if c.cell_type == "code" and graded_points(c.source) is not None
    ]


def formula_points(points: list[int]) -> int:
    """The points of `FORMULA_EXERCISES` (exercise i is graded cell i)."""
    return sum(points[i - 1] for i in FORMULA_EXERCISES)
