"""The table of contents lists only pages that exist, chapter notebooks are current, and
every code listing finds the code it names."""

import ast
import pathlib
import re

import pytest

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


LISTING = re.compile(r"^```\{literalinclude\} (\S+)\n((?::[a-z-]+:.*\n)*)", re.MULTILINE)


def python_object_lines(source: str, dotted: str) -> tuple[int, int]:
    """(first, last) line, 1-based, of a module-level def or class, or a method `Class.name`."""
    body = ast.parse(source).body
    node = None
    for name in dotted.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and n.name == name
            ),
            None,
        )
        assert node is not None, f"no {dotted}"
        body = node.body
    return node.lineno, node.end_lineno


def listed_lines(page: pathlib.Path, target: str, options: dict[str, str]) -> list[str]:
    """The lines Sphinx's literalinclude shows: pyobject, then lines, then start/end."""
    path = (page.parent / target).resolve()
    assert path.is_file(), f"{page.name}: {target} does not exist"
    text = path.read_text()
    lines = text.splitlines()
    if "pyobject" in options:
        first, last = python_object_lines(text, options["pyobject"])
        lines = lines[first - 1 : last]
    if "lines" in options:
        picked = []
        for part in options["lines"].split(","):
            low, _, high = part.strip().partition("-")
            stop = int(high) if high else (len(lines) if _ else int(low))
            picked += lines[int(low) - 1 : stop]
        lines = picked
    for key in ("start-at", "start-after"):
        if key in options:
            at = next((i for i, line in enumerate(lines) if options[key] in line), None)
            assert at is not None, f"{page.name}: :{key}: {options[key]!r} not in {target}"
            lines = lines[at if key == "start-at" else at + 1 :]
    for key in ("end-at", "end-before"):
        if key in options:
            at = next((i for i, line in enumerate(lines) if options[key] in line), None)
            assert at is not None, f"{page.name}: :{key}: {options[key]!r} not in {target}"
            lines = lines[: at + 1 if key == "end-at" else at]
    return lines


def test_every_listing_finds_its_code():
    """Each `literalinclude` of a chapter names a file, object and markers that exist, so
    that moving engine code cannot leave a listing pointing at nothing (the strict build
    finds the same, but only after executing every page)."""
    count = 0
    for page in sorted((ROOT / "book").glob("*.md")):
        for target, block in LISTING.findall(page.read_text()):
            options = {}
            for line in block.splitlines():
                key, _, value = line[1:].partition(":")
                options[key] = value.strip()
            assert listed_lines(page, target, options), f"{page.name}: {target} lists nothing"
            count += 1
    assert count >= 100


def test_the_listing_reader_fails_a_moved_marker(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "m.py").write_text("class A:\n    def f(self):\n        x = 1\n        return x\n")
    assert listed_lines(page, "m.py", {"pyobject": "A.f", "start-at": "x = 1"}) == [
        "        x = 1",
        "        return x",
    ]
    assert listed_lines(page, "m.py", {"lines": "2-3"}) == ["    def f(self):", "        x = 1"]
    with pytest.raises(AssertionError, match="not in"):
        listed_lines(page, "m.py", {"pyobject": "A.f", "start-at": "y = 2"})
    with pytest.raises(AssertionError, match="no A.g"):
        listed_lines(page, "m.py", {"pyobject": "A.g"})
