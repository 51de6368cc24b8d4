"""Chapter 8's page setup: the catalog entries it returns and the exercise points it counts."""

import json

import torch

from minillm.lab import ch08_setup


def test_start_page_runs_on_one_thread_and_returns_the_chapter_catalog():
    before = torch.get_num_threads()
    try:
        ch = ch08_setup.start_page()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert ch.llama70b.num_hidden_layers == 80 and ch.llama70b.hidden_size == 8192
    assert ch.llama8b.num_hidden_layers == 32
    assert ch.h100.name == "H100 SXM"
    # NVLink 4 moves 450 GB/s each way, PCIe Gen5 x16 about 63 and Gen4 half that
    assert ch.nvlink.bandwidth_bytes_per_s > 5 * ch.pcie5.bandwidth_bytes_per_s
    assert 1.9 < ch.pcie5.bandwidth_bytes_per_s / ch.pcie4.bandwidth_bytes_per_s < 2.1


def test_exercise_points_read_the_graded_markers_in_order(tmp_path):
    def cell(kind, source):
        extra = {"outputs": [], "execution_count": None} if kind == "code" else {}
        return {
            "cell_type": kind,
            "id": f"c{len(source)}",
            "metadata": {},
            "source": source,
            **extra,
        }

    cells = [
        cell("code", "x = 1"),
        cell("code", "# GRADED: 3 points\nassert x == 1"),
        cell("markdown", "# GRADED: 5 points (prose, not a check)"),
        cell("code", "# GRADED: 2 points\nassert True"),
    ]
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "ex.ipynb"
    path.write_text(json.dumps(nb))
    assert ch08_setup.exercise_points(path) == [3, 2]
    assert ch08_setup.exercise_points(tmp_path / "missing.ipynb") is None
