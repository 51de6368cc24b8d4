"""Chapter 1's shared setup: the model both pages load, the demo request, the exercise points."""

from __future__ import annotations

import ast
import json
import pathlib
import re

import nbformat
import pytest

from minillm import SamplingParams
from minillm.lab.ch01_setup import (
    DEMO_PROMPT,
    demo_params,
    exercise_points,
    load_bundled_model,
    shown,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIRST_PAGE = ROOT / "book" / "01_request_journey.md"
EXERCISES = ROOT / "exercises" / "ch01_request_journey.ipynb"


def assignment(source: str, name: str) -> str:
    """The right-hand side of the one line `name = ...` in a page's source."""
    (line,) = [line for line in source.splitlines() if line.startswith(f"{name} = ")]
    return line.split(" = ", 1)[1]


def test_the_demo_request_is_the_one_the_first_page_builds():
    # the first page shows the request as code; the second rebuilds it from this module
    source = FIRST_PAGE.read_text()
    assert ast.literal_eval(assignment(source, "prompt")) == DEMO_PROMPT
    shown_params = eval(assignment(source, "greedy"), {"SamplingParams": SamplingParams})
    assert shown_params == demo_params()
    assert demo_params().temperature == 0.0 and list(demo_params().stop) == ["\n\n"]


def test_exercise_points_are_those_of_the_graded_cells():
    # oracle: the markers read straight from the notebook's JSON, code cells only
    cells = json.loads(EXERCISES.read_text())["cells"]
    marker = re.compile(r"#\s*GRADED:\s*(\d+)\s*points?")
    expected = [
        int(m.group(1))
        for cell in cells
        if cell["cell_type"] == "code" and (m := marker.search("".join(cell["source"])))
    ]
    assert exercise_points(EXERCISES) == expected
    assert len(expected) >= 8 and sum(expected) >= 20  # the chapter standard


def test_exercise_points_skip_markdown_and_ungraded_cells(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# GRADED: 5 points"),
        nbformat.v4.new_code_cell("# GRADED: 2 points\nassert True"),
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("# GRADED: 1 point\nassert x == 1"),
    ]
    path = tmp_path / "exercises.ipynb"
    nbformat.write(notebook, path)
    assert exercise_points(path) == [2, 1]
    assert exercise_points(str(path)) == [2, 1]


def test_exercise_points_of_a_missing_notebook_are_none(tmp_path):
    assert exercise_points(tmp_path / "absent.ipynb") is None


def test_shown_writes_text_as_python_does_with_html_escaped():
    assert shown("a b\n").text == "<code>&#x27;a b\\n&#x27;</code>"
    assert shown("<é>").text == "<code>&#x27;&lt;é&gt;&#x27;</code>"


@pytest.fixture(scope="module")
def bundled():
    return load_bundled_model()


def test_the_bundled_model_computes_in_float32(bundled):
    assert bundled.model_dtype == "float32"
    assert all(
        p.dtype.is_floating_point and str(p.dtype) == "torch.float32"
        for p in bundled.model.parameters()
    )
    assert bundled.config is bundled.llm.engine.config
    assert bundled.tokenizer is bundled.llm.get_tokenizer()


def test_the_bundled_model_is_warmed_up_and_idle(bundled):
    stats = bundled.llm.engine.stats
    assert stats.num_steps >= 1  # the warm-up request ran
    assert not bundled.llm.engine.has_unfinished_requests()


def test_the_demo_request_stops_at_the_blank_line_after_its_function(bundled):
    out = bundled.llm.generate(DEMO_PROMPT, demo_params(), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "\n\n"
    assert 0 < len(out.token_ids) < demo_params().max_tokens
