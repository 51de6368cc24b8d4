"""Chapter 7's page setup: the engine it builds and the exercise points it counts."""

import pathlib

import nbformat
import torch

from minillm.lab import ch07_setup

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_start_page_gives_the_target_engine_on_one_thread():
    before = torch.get_num_threads()
    try:
        llm, tokenizer = ch07_setup.start_page()
        assert torch.get_num_threads() == 1
        ids = tokenizer.encode("def f(x):", add_special_tokens=False)
        assert tokenizer.decode(ids) == "def f(x):"
        assert llm.get_tokenizer() is tokenizer
        llm.shutdown()
    finally:
        torch.set_num_threads(before)


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
    assert ch07_setup.exercise_points(path) == [3, 1]
    assert ch07_setup.exercise_points(tmp_path / "missing.ipynb") is None


def test_exercise_points_of_the_chapter_match_its_graded_checks():
    # the same list the checks of tests/book/test_ch07_decoding.py grade
    points = ch07_setup.exercise_points(ROOT / "exercises" / "ch07_decoding.ipynb")
    assert points == [3, 2, 2, 4, 2, 3, 3, 3, 3, 3, 2, 6, 5]
