"""Generate each chapter's Colab notebook (`book/NN_name.ipynb`) from its MyST source.

The chapter's `.md` file is the source, reviewed as text. Colab opens only `.ipynb`, so
`minillm notebooks` writes a notebook beside every executable chapter: the bootstrap
cell first (it installs minillm on Colab and does nothing elsewhere), then the chapter's
cells with outputs stripped. The result is deterministic, so a test can regenerate it
and compare bytes to catch a stale copy.
"""

from __future__ import annotations

import argparse
import pathlib

import nbformat

from minillm.course.bootstrap import bootstrap_cell, repository_url

BOOK_DIR = "book"


def is_executable_page(md_path: pathlib.Path) -> bool:
    """A MyST page runs as a notebook only with a jupytext header and a kernelspec."""
    text = md_path.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        return False
    header = text.split("\n---\n", 1)[0]
    return "jupytext:" in header and "kernelspec:" in header


def chapter_notebook(md_path: pathlib.Path, repo_url: str) -> str:
    """The `.ipynb` text for one chapter: bootstrap cell, then its cells, no outputs."""
    import jupytext  # a book dependency; imported here so `minillm --help` stays light

    nb = jupytext.read(md_path, fmt="md:myst")
    cells = [bootstrap_cell(repo_url)]
    for cell in nb.cells:
        if cell.cell_type == "code":
            new = nbformat.v4.new_code_cell(cell.source)
        elif cell.cell_type == "markdown":
            new = nbformat.v4.new_markdown_cell(cell.source)
        else:
            new = nbformat.v4.new_raw_cell(cell.source)
        tags = cell.metadata.get("tags")
        if tags:
            new.metadata["tags"] = list(tags)
        cells.append(new)
    out = nbformat.v4.new_notebook(cells=cells)
    out.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    # Deterministic ids: regenerating must give identical bytes.
    for i, cell in enumerate(out.cells):
        cell.id = f"cell-{i}"
    return nbformat.writes(out, version=4) + "\n"


def expected_notebooks(root: pathlib.Path) -> dict[pathlib.Path, str]:
    """Every chapter notebook that should exist under `root/book`, with its text."""
    repo_url = repository_url(root / "_config.yml")
    pages = sorted((root / BOOK_DIR).glob("*.md"))
    return {
        md.with_suffix(".ipynb"): chapter_notebook(md, repo_url)
        for md in pages
        if is_executable_page(md)
    }


def stale_notebooks(root: pathlib.Path) -> list[pathlib.Path]:
    """Notebooks that are missing, differ from their source, or have no source."""
    expected = expected_notebooks(root)
    stale = [p for p, text in expected.items() if not p.exists() or p.read_text() != text]
    orphans = [p for p in (root / BOOK_DIR).glob("*.ipynb") if p not in expected]
    return sorted(stale + orphans)


def write_notebooks(root: pathlib.Path) -> list[pathlib.Path]:
    """Regenerate every chapter notebook; remove those whose source is gone."""
    expected = expected_notebooks(root)
    for path in (root / BOOK_DIR).glob("*.ipynb"):
        if path not in expected:
            path.unlink()
    for path, text in expected.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return sorted(expected)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "notebooks", help="regenerate book/*.ipynb (for Colab) from the book/*.md sources"
    )
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument(
        "--check", action="store_true", help="only report stale notebooks; exit 1 if any"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.check:
        stale = stale_notebooks(args.root)
        for path in stale:
            print(f"stale: {path} (run `make notebooks`)")
        return 1 if stale else 0
    for path in write_notebooks(args.root):
        print(f"wrote {path}")
    return 0
