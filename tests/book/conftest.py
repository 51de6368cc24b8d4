"""Fixtures for checks of the built book: where the HTML is and which pages it has."""

import os
import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def toc_files() -> list[str]:
    """Every page listed in _toc.yml, as a path relative to the root without suffix."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        for chapter in part.get("chapters", []):
            files.append(chapter["file"])
            files.extend(section["file"] for section in chapter.get("sections", []))
    return files


def source_of(page: str) -> pathlib.Path:
    for suffix in (".md", ".ipynb"):
        path = ROOT / f"{page}{suffix}"
        if path.exists():
            return path
    raise FileNotFoundError(f"_toc.yml lists {page!r}, but neither .md nor .ipynb exists")


@pytest.fixture(scope="session")
def html_dir() -> pathlib.Path:
    """The built HTML book: $MINILLM_BOOK_HTML (set by `make test`) or _build/html."""
    configured = os.environ.get("MINILLM_BOOK_HTML")
    path = pathlib.Path(configured) if configured else ROOT / "_build" / "html"
    if not path.is_absolute():
        path = ROOT / path
    if not (path / "index.html").exists():
        if configured:
            pytest.fail(f"MINILLM_BOOK_HTML={configured} holds no built book (no index.html)")
        pytest.skip("the book is not built; run `make book` first")
    return path
