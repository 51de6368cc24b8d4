"""The table of contents lists only pages that exist, and chapter notebooks are current."""

from minillm.course.notebooks import stale_notebooks

from .conftest import ROOT, source_of, toc_files


def test_every_toc_entry_has_a_source():
    for page in toc_files():
        assert source_of(page).exists()


def test_chapter_notebooks_are_current():
    stale = stale_notebooks(ROOT)
    assert stale == [], f"stale chapter notebooks, run `make notebooks`: {stale}"


def test_every_executable_chapter_has_a_notebook_for_colab():
    for page in toc_files():
        src = source_of(page)
        if src.suffix == ".md" and "kernelspec:" in src.read_text().split("\n---\n", 1)[0]:
            assert src.with_suffix(".ipynb").exists(), f"{src} has no generated .ipynb"
