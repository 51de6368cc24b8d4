"""What the pages of chapter 2 (inference physics and the roofline) share.

The chapter is two pages (`book/02_roofline.md`, `book/02_roofline_batching.md`), and
Jupyter Book runs each in a fresh kernel. Each page's hidden setup cell calls `start_page`
(the house style, torch on one thread so that the timings of the second page stay steady
when other programs share the cores). Both pages place decode against the same reference
accelerator, the H100 SXM in bfloat16, which `reference_roof` reads from
`minillm.lab.hardware`. The first page quotes the exercises' points in its front matter and
the last page describes the exercises, so both count them with `exercise_points`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minillm.lab import roofline
from minillm.lab.exercise_count import exercise_points  # noqa: F401  (the pages' name)
from minillm.lab.figures import use_house_style
from minillm.lab.hardware import DeviceSpec, get_device

REFERENCE_DEVICE = "H100 SXM"
REFERENCE_FORMAT = "bfloat16"


class Roof(NamedTuple):
    """A device's roofline in one compute format: its peak, its bandwidth, its ridge."""

    spec: DeviceSpec
    peak_flops_per_s: float  # dense
    bandwidth_bytes_per_s: float
    ridge_flop_per_byte: float


def start_page() -> None:
    """The house style for figures, and torch on one thread."""
    use_house_style()
    # one thread: on a shared machine, threads that wait for each other at every small
    # operation make the chapter's measurements jump by many times
    torch.set_num_threads(1)


def reference_roof(device: str = REFERENCE_DEVICE, fmt: str = REFERENCE_FORMAT) -> Roof:
    """The dense roofline of `device` in `fmt`, from its datasheet row."""
    spec = get_device(device)
    peak, bandwidth = spec.peak_flops(fmt), spec.memory_bandwidth_bytes_per_s
    return Roof(spec, peak, bandwidth, roofline.ridge_point(peak, bandwidth))
