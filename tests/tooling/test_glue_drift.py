"""glue_drift finds the glued words that differ between builds of the book, and only those."""

import json

import pytest

from minillm.course import glue_drift


def glue_output(name, text_plain):
    return {
        "output_type": "display_data",
        "metadata": {"scrapbook": {"name": name, "mime_prefix": "application/papermill.record/"}},
        "data": {"text/plain": text_plain},
    }


def write_build(root, pages):
    """pages: {page name: {key: repr of the glued value}} as myst-nb writes them."""
    folder = root / "_build" / "jupyter_execute" / "book"
    folder.mkdir(parents=True)
    for page, glues in pages.items():
        data = {key: glue_output(key, text) for key, text in glues.items()}
        (folder / f"{page}.glue.json").write_text(json.dumps(data))
    return root


def test_only_words_that_differ_are_reported(tmp_path):
    a = write_build(
        tmp_path / "a",
        {"04_scheduling": {"ttft": "'later'", "steps": "115", "same": "'the same'"}},
    )
    b = write_build(
        tmp_path / "b",
        {"04_scheduling": {"ttft": "'earlier'", "steps": "131", "same": "'the same'"}},
    )
    assert glue_drift.text_glues(a) == {("04", "ttft"): "later", ("04", "same"): "the same"}
    # the number moved (load), the word flipped (a claim): only the word is reported
    assert glue_drift.drift([a, b]) == {("04", "ttft"): ["later", "earlier"]}
    assert glue_drift.main([str(a), str(b)]) == 1
    assert glue_drift.main([str(a), str(a)]) == 0


def test_numbers_inside_a_sentence_do_not_count(tmp_path):
    a = write_build(tmp_path / "a", {"04_x": {"s": "'longer (663 ms): it grows'"}})
    b = write_build(tmp_path / "b", {"04_x": {"s": "'longer (1,604.5 ms): it grows'"}})
    c = write_build(tmp_path / "c", {"04_x": {"s": "'shorter (604 ms): it grows'"}})
    assert glue_drift.drift([a, b]) == {}
    assert glue_drift.drift([a, b, c]) == {
        ("04", "s"): [
            "longer (663 ms): it grows",
            "longer (1,604.5 ms): it grows",
            "shorter (604 ms): it grows",
        ]
    }


def test_a_key_that_moved_to_another_page_of_its_chapter_still_compares(tmp_path):
    a = write_build(tmp_path / "a", {"03_kv_cache": {"fits": "'fits'"}})
    b = write_build(tmp_path / "b", {"03_kv_cache_pressure": {"fits": "'does not fit'"}})
    assert glue_drift.drift([a, b]) == {("03", "fits"): ["fits", "does not fit"]}


def test_keys_missing_from_a_build_and_non_literals_are_left_out(tmp_path):
    a = write_build(tmp_path / "a", {"01_x": {"only_here": "'x'", "obj": "<Figure size 1x1>"}})
    b = write_build(tmp_path / "b", {"01_x": {"obj": "<Figure size 2x2>"}})
    assert glue_drift.drift([a, b]) == {}
    assert glue_drift.text_glues(a) == {("01", "only_here"): "x"}


def test_needs_two_builds_and_a_build_folder(tmp_path):
    with pytest.raises(ValueError, match="at least two builds"):
        glue_drift.drift([tmp_path])
    with pytest.raises(FileNotFoundError, match="no jupyter_execute folder"):
        glue_drift.text_glues(tmp_path)


def test_lists_and_ranges_of_numbers_count_as_numbers(tmp_path):
    a = write_build(tmp_path / "a", {"10_x": {"r": "'79, 80'", "s": "'from 1.2 to 1.4'"}})
    b = write_build(tmp_path / "b", {"10_x": {"r": "'79'", "s": "'from 1.3 to 1.3'"}})
    assert glue_drift.drift([a, b]) == {}
    c = write_build(tmp_path / "c", {"10_x": {"r": "'79 s'", "s": "'up to 1.3'"}})
    assert glue_drift.drift([a, c]) == {
        ("10", "r"): ["79, 80", "79 s"],
        ("10", "s"): ["from 1.2 to 1.4", "up to 1.3"],
    }


def test_outcomes_are_listed_apart_and_do_not_fail(tmp_path, capsys):
    a = write_build(tmp_path / "a", {"09_x": {"ab_verdict_outcome": "'B worse'"}})
    b = write_build(tmp_path / "b", {"09_x": {"ab_verdict_outcome": "'no difference'"}})
    assert glue_drift.drift([a, b]) == {}
    assert glue_drift.drift([a, b], outcomes=True) == {
        ("09", "ab_verdict_outcome"): ["B worse", "no difference"]
    }
    assert glue_drift.main([str(a), str(b)]) == 0
    assert "outcome, chapter 09, ab_verdict_outcome" in capsys.readouterr().out
    # the suffix is the whole marker: the same key without it is a claim
    c = write_build(tmp_path / "c", {"09_x": {"ab_verdict": "'B worse'"}})
    d = write_build(tmp_path / "d", {"09_x": {"ab_verdict": "'no difference'"}})
    assert glue_drift.main([str(c), str(d)]) == 1
