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
