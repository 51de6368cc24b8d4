"""The Colab copies of the chapters (book/*.ipynb) run outside a clone of the repository.

On Colab a chapter's notebook runs on its own, with minillm installed by pip and none of
the repository's other files (no _toc.yml, no exercises/, no benchmarks/) nor the book's
tools (myst-nb, jupytext, jupyter-book, PyYAML as a dependency). Each copy runs here in an
empty temporary folder, minillm imported from this environment as the notebook's bootstrap
cell finds it, with the book's tools made unimportable by a first cell; so a page that
needs one of them, or reads a repository file without checking that it exists, fails here
rather than in a reader's browser.
"""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
COPIES = sorted((ROOT / "book").glob("*.ipynb"))
# what pip-installed minillm does not bring: importing any of them raises ImportError
BOOK_TOOLS = ("myst_nb", "jupytext", "jupyter_book", "yaml")
HIDE_BOOK_TOOLS = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in BOOK_TOOLS)


def test_there_are_copies_to_run():
    assert len(COPIES) >= 6


@pytest.mark.slow
@pytest.mark.parametrize("path", COPIES, ids=[p.stem for p in COPIES])
def test_colab_copy_runs_outside_the_repository(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(HIDE_BOOK_TOOLS))
    client = NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, when one fails
