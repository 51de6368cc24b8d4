"""The book's computed tables (minillm.lab.figures.table)."""

import html
import re

import pytest

from minillm.lab.figures import code, plain_log_ticks, table


def text_of(cell_html: str) -> str:
    """What a reader sees (and copies) of a cell: the HTML without its tags."""
    return html.unescape(re.sub(r"<[^>]+>", "", cell_html))


def test_paths_and_names_may_wrap_at_their_separators_only():
    shown = table(["component", "minillm"], [["KV manager", "minillm/core/kv_cache_manager.py"]])
    cells = re.findall(r"<td[^>]*>(.*?)</td>", shown._repr_html_())
    assert cells[1] == "minillm/<wbr>core/<wbr>kv_<wbr>cache_<wbr>manager.py"
    assert text_of(cells[1]) == "minillm/core/kv_cache_manager.py"
    assert cells[0] == "KV manager"  # plain words wrap at spaces already


def test_cells_stay_escaped_and_numbers_align_right():
    shown = table(
        ["flag", "value"], [[code("--max_num_seqs"), 1024], ["<b>", "1,024"]]
    )._repr_html_()
    assert "<code>--max_<wbr>num_<wbr>seqs</code>" in shown
    assert "&lt;b&gt;" in shown and "<b>" not in shown
    assert re.findall(r"<td class=\"text-right\">([^<]*)</td>", shown) == ["1,024", "1,024"]


def test_a_row_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="a row of 1 cells under a header of 2"):
        table(["a", "b"], [[1]])


def visible_labels(ax):
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    return [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high]


def test_a_log_axis_under_a_decade_is_labelled_in_plain_numbers():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [30, 80])
    ax.set_yscale("log")
    ax.set_ylim(30, 80)
    plain_log_ticks(ax.yaxis)
    labels = visible_labels(ax)  # within a decade: plain round values, never "3×10¹"
    assert len(labels) >= 2 and all(re.fullmatch(r"\d+", label) for label in labels), labels
    ax.set_ylim(0.5, 300)
    assert visible_labels(ax) == ["0.5", "1", "2", "5", "10", "20", "50", "100", "200"]
    plt.close(fig)
