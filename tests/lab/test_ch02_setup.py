"""Chapter 2's page setup: the reference roofline its pages share and the points it counts."""

import pathlib

import nbformat
import pytest
import torch

from minillm.lab import ch02_setup

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_start_page_runs_torch_on_one_thread():
    before = torch.get_num_threads()
    try:
        ch02_setup.start_page()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_reference_roof_is_the_h100_dense_bfloat16_datasheet_row():
    roof = ch02_setup.reference_roof()
    assert roof.spec.name == "H100 SXM"
    assert roof.peak_flops_per_s == pytest.approx(989.4e12)  # dense, not the sparse 1,979
    assert roof.bandwidth_bytes_per_s == pytest.approx(3.35e12)
    assert roof.ridge_flop_per_byte == pytest.approx(989.4 / 3.35)


def test_reference_roof_of_another_device_and_format():
    roof = ch02_setup.reference_roof("H200 SXM", "fp8_e4m3")
    # the H200 has the H100's tensor cores (dense fp8 at twice bf16, as the datasheet
    # rounds it) and faster memory
    assert roof.peak_flops_per_s == pytest.approx(1978.9e12)
    assert roof.bandwidth_bytes_per_s == pytest.approx(4.8e12)
    assert roof.ridge_flop_per_byte == pytest.approx(1978.9 / 4.8)


def test_exercise_points_read_the_graded_markers_in_order(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("# GRADED: 3 points\nassert x == 1"),
        nbformat.v4.new_markdown_cell("# GRADED: 5 points (prose, not a check)"),
        nbformat.v4.new_code_cell("# GRADED: 1 point\nassert True"),
    ]
    path = tmp_path / "ex.ipynb"
    path.write_text(nbformat.writes(nb))
    assert ch02_setup.exercise_points(path) == [3, 1]
    assert ch02_setup.exercise_points(tmp_path / "missing.ipynb") is None


def test_exercise_points_of_the_chapter():
    points = ch02_setup.exercise_points(ROOT / "exercises" / "ch02_roofline.ipynb")
    assert points == [3, 4, 2, 2, 4, 3, 4, 2]
