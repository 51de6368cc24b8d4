"""Explorers for the HTML book: every combination of slider values drawn once, in the order
the page's script indexes them, with nothing loaded from elsewhere."""

from __future__ import annotations

import re

import pytest
from matplotlib.figure import Figure

from minillm.lab.explorer import MAX_STATES, Explorer


def draw_recorder(calls):
    def draw(**values):
        calls.append(values)
        figure = Figure(figsize=(2, 1))
        figure.add_subplot().set_title(str(values))
        return figure

    return draw


def test_every_combination_is_drawn_in_the_order_the_script_indexes():
    calls = []
    explorer = Explorer(
        draw_recorder(calls), {"a": [1, 2, 3], "b": ["x", "y"]}, alt="a test figure of values"
    )
    assert calls == [{"a": a, "b": b} for a in (1, 2, 3) for b in ("x", "y")]
    assert len(explorer.images) == 6 and len(set(explorer.images)) == 6
    # row-major: the last slider moves fastest, as the JavaScript computes it
    assert explorer.index_of([0, 0]) == 0
    assert explorer.index_of([0, 1]) == 1
    assert explorer.index_of([2, 1]) == 5
    assert calls[explorer.index_of([1, 0])] == {"a": 2, "b": "x"}
    with pytest.raises(IndexError):
        explorer.index_of([3, 0])


def test_the_html_is_self_contained():
    explorer = Explorer(
        draw_recorder([]),
        {"context": [1024, 8192]},
        alt="bars of bytes per model",
        labels={"context": "context (tokens)"},
        initial={"context": 8192},
    )
    page = explorer._repr_html_()
    assert page.count('type="range"') == 1 and 'value="1"' in page
    assert "context (tokens)" in page and 'alt="bars of bytes per model"' in page
    assert re.findall(r'src="(?!data:image/png;base64,)', page) == []  # no external source
    assert "http" not in page
    # the image shown first is the initial state's
    assert explorer.images[1] in page.split("<script>")[0]


def test_names_are_a_menu_and_numbers_a_slider_with_ticks():
    explorer = Explorer(
        draw_recorder([]),
        {"model": ["Qwen3-8B", "Llama <3>"], "context": [1024, 8192, 32768]},
        alt="bars of bytes per model",
        initial={"model": "Llama <3>"},
    )
    page = explorer._repr_html_()
    assert page.count("<select") == 1 and page.count('type="range"') == 1
    options = re.findall(r"<option value=\"(\d)\"( selected)?>([^<]+)</option>", page)
    assert options == [("0", "", "Qwen3-8B"), ("1", " selected", "Llama &lt;3&gt;")]
    # one tick mark per context drawn
    assert len(re.findall(r'<option value="\d"></option>', page)) == 3


def test_bad_explorers_are_refused():
    draw = draw_recorder([])
    with pytest.raises(ValueError, match="at least one slider"):
        Explorer(draw, {}, alt="a figure of nothing here")
    with pytest.raises(ValueError, match="at least two values"):
        Explorer(draw, {"a": [1]}, alt="a figure of one value")
    with pytest.raises(ValueError, match=f"at most {MAX_STATES}"):
        Explorer(draw, {"a": list(range(9)), "b": list(range(8))}, alt="a figure too large here")
    with pytest.raises(ValueError, match="four words"):
        Explorer(draw, {"a": [1, 2]}, alt="plot.png")
