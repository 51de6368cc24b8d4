"""What both pages of chapter 8 (distributed and disaggregated inference) start from.

The chapter is two pages (`book/08_distributed.md`, `08_distributed_moe_and_pd.md`), and
Jupyter Book runs each in a fresh kernel. Each page's hidden setup cell calls `start_page`,
which applies the house style, seeds torch and runs it on one thread (steadier timings when
other programs share the cores), and returns the catalog entries both pages price: two Llama
models, the H100 SXM and three links. The first page quotes the exercises' points in its
front matter and the second describes the exercises, so both count them with
`exercise_points`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.lab import interconnect
from minillm.lab.catalog import get_model_config
from minillm.lab.exercise_count import exercise_points  # noqa: F401  (the pages' name)
from minillm.lab.figures import use_house_style
from minillm.lab.hardware import DeviceSpec, get_device
from minillm.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Chapter8:
    """The models, GPU and links the chapter's calculators are run on."""

    llama8b: ModelConfig
    llama70b: ModelConfig
    h100: DeviceSpec
    nvlink: interconnect.Link  # NVLink 4, as on H100/H200 SXM
    pcie5: interconnect.Link  # PCIe Gen5 x16
    pcie4: interconnect.Link  # PCIe Gen4 x16


def start_page(seed: int = 0) -> Chapter8:
    """House style, `torch.manual_seed(seed)`, one torch thread; the chapter's catalog entries."""
    use_house_style()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    return Chapter8(
        llama8b=get_model_config("Llama 3.1 8B"),
        llama70b=get_model_config("Llama 3.3 70B"),
        h100=get_device("H100 SXM"),
        nvlink=interconnect.get_link("NVLink 4 (H100/H200 SXM)"),
        pcie5=interconnect.get_link("PCIe Gen5 x16"),
        pcie4=interconnect.get_link("PCIe Gen4 x16"),
    )
