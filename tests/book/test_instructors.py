"""The instructor's guide: the figures it computes from the chapters and solutions."""

import json
import re

import pytest

from minillm.course import timing

from .conftest import ROOT, toc_files

PAGE = """---
jupytext:
  text_representation:
    format_name: myst
---

# A title here

**Learning goals.** When you finish, you can

- count the {term}`KV cache` bytes;
- read a trace.

**Prerequisites.** Chapter 1 ({ref}`journey-decode`) and {ref}`the preface <preface>`.

```{code-cell} ipython3
these words are code and do not count
```

Four more words here.
"""


def test_word_count_leaves_out_front_matter_and_code():
    # counted by hand: title 3, goals line 7, goals 6 + 3, prerequisites 10 (a role's
    # name counts as a word), last line 4
    assert timing.word_count(PAGE) == 33
    assert timing.word_count(PAGE.replace("do not count", "x x x x x")) == 33
    assert timing.word_count(PAGE + "one two three") == 36


@pytest.mark.parametrize(
    ("words", "minutes"), [(1, 5), (1000, 5), (1001, 10), (2000, 10), (2001, 15)]
)
def test_reading_minutes_round_up_to_five(words, minutes):
    assert timing.reading_minutes("word " * words, words_per_minute=200) == minutes


def test_a_chapter_in_pages_counts_each_page_without_its_front_matter():
    assert timing.chapter_word_count([PAGE, PAGE]) == 2 * timing.word_count(PAGE) == 66
    assert timing.reading_minutes(["word " * 1000, "word " * 1001], words_per_minute=200) == 15
    assert timing.reading_minutes("word " * 2001, words_per_minute=200) == 15


def test_reading_rate_must_be_positive():
    with pytest.raises(ValueError, match="words_per_minute"):
        timing.reading_minutes("a b c", words_per_minute=0)


def test_goals_prerequisites_and_title_are_read_from_the_top():
    assert timing.title(PAGE) == "A title here"
    assert timing.learning_goals(PAGE) == ["count the {term}`KV cache` bytes", "read a trace"]
    assert timing.plain(timing.learning_goals(PAGE)[0]) == "count the KV cache bytes"
    assert timing.plain(timing.prerequisites(PAGE)) == "Chapter 1 and the preface."
    assert timing.learning_goals("no goals") == [] and timing.prerequisites("none") == ""


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.stem)
def test_points_are_the_sum_of_the_graded_markers(path):
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    by_hand = sum(int(m) for s in sources for m in re.findall(r"GRADED: (\d+) points?", s))
    assert by_hand > 0
    assert timing.solution_points(path) == by_hand


def test_every_solution_has_a_measured_time_from_a_clean_run():
    data = timing.load_times(ROOT)
    assert data["machine"]["cpu"] and data["date"]
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        entry = data["notebooks"].get(path.stem)
        assert entry is not None, (
            f"{path.stem} has no measured time: run python -m {timing.__name__}"
        )
        assert entry["seconds"] > 0 and entry["failed_cells"] == []


def test_the_class_grading_time_says_where_and_under_what_load_it_ran():
    entry = timing.load_times(ROOT)["class_grading"]
    assert entry["seconds"] > 0 and entry["date"] and entry["machine"]["cpu_count"]
    assert entry["load_average"] and "shared" in entry["note"]


def test_record_times_keeps_the_class_grading_time(tmp_path):
    import json

    import nbformat

    (tmp_path / "solutions").mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    nbformat.write(nb, tmp_path / "solutions" / "ch01_one.ipynb")
    (tmp_path / timing.TIMES_FILE).parent.mkdir(parents=True)
    (tmp_path / timing.TIMES_FILE).write_text(json.dumps({"class_grading": {"seconds": 9.0}}))
    assert timing.record_times(tmp_path)["class_grading"] == {"seconds": 9.0}


def test_timing_names_unknown_solutions():
    with pytest.raises(ValueError, match="no solution notebook"):
        timing.record_times(ROOT, ["ch99_nothing"])


def test_the_guide_is_in_the_reference_part_before_the_glossary():
    pages = toc_files()
    assert pages.index("book/instructors") == pages.index("book/glossary") - 1


def test_record_times_runs_each_solution_and_notes_failed_cells(tmp_path):
    import nbformat

    (tmp_path / "solutions").mkdir()
    good = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("import time; time.sleep(0.3)")]
    )
    bad = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("1 / 0")]
    )
    nbformat.write(good, tmp_path / "solutions" / "ch01_good.ipynb")
    nbformat.write(bad, tmp_path / "solutions" / "ch02_bad.ipynb")
    data = timing.record_times(tmp_path)
    assert data["notebooks"]["ch01_good"]["seconds"] >= 0.3
    assert data["notebooks"]["ch01_good"]["failed_cells"] == []
    assert data["notebooks"]["ch02_bad"]["failed_cells"] == [1]
    # each run records the load it ran under: a number, as the OS reports it
    load = data["notebooks"]["ch01_good"]["load_1m"]
    assert isinstance(load, float) and load >= 0
    assert timing.load_times(tmp_path) == data
    # timing one keeps the others' entries
    again = timing.record_times(tmp_path, ["ch01_good"])
    assert again["notebooks"]["ch02_bad"] == data["notebooks"]["ch02_bad"]


@pytest.mark.parametrize(
    ("line", "minutes"),
    [
        ("**Time.** About 60 minutes to read and run, and 90 minutes for the exercises", (60, 90)),
        ("**Time.** About 110 minutes to read and run, and 2 hours for the exercises", (110, 120)),
        ("**Time.** About 1 hour to read and run,\nand 1 hour for the exercises", (60, 60)),
        ("**Time.** An afternoon.", None),
        ("no time line", None),
    ],
)
def test_authors_minutes_reads_the_chapter_s_time_line(line, minutes):
    assert timing.authors_minutes(f"# Title\n\n{line}\n({{glue:text}}`x` points).\n") == minutes


def test_every_chapter_states_its_time_and_the_guide_can_read_it():
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    firsts = [
        chapter["file"]
        for part in toc["parts"]
        for chapter in part["chapters"]
        if re.fullmatch(r"book/(0[1-9]|10)_\w+", chapter["file"])
    ]
    assert len(firsts) == 10
    for page in firsts:
        minutes = timing.authors_minutes((ROOT / f"{page}.md").read_text())
        assert minutes is not None and min(minutes) >= 30, page


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.stem)
def test_the_guide_counts_the_same_points_in_the_exercises_as_in_the_solutions(path):
    # the guide reads exercises/, which a student edition keeps
    assert timing.solution_points(ROOT / "exercises" / path.name) == timing.solution_points(path)
