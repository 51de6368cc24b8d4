"""The bootstrap cell: read the URL from _config.yml; install only where minillm is missing."""

from __future__ import annotations

import nbformat
import pytest

from minillm.course.bootstrap import (
    bootstrap_cell,
    bootstrap_source,
    is_bootstrap_cell,
    looks_like_bootstrap_cell,
    repository_url,
)
from minillm.course.notebook_io import execute_notebook

from .conftest import REPO_URL, code

EXPECTED_SOURCE = f"""\
# Setup: installs minillm when it is not importable (e.g. on Colab); otherwise does nothing.
try:
    import minillm  # noqa: F401
except ImportError:
    %pip install --quiet "minillm[book] @ git+{REPO_URL}\""""

# Replaces %pip with a recorder and makes `import minillm` fail, as on a fresh Colab runtime.
FAKE_COLAB = """\
import sys

from IPython.core.magic import register_line_magic


@register_line_magic
def pip(line):
    print("pip", line)


sys.modules["minillm"] = None"""


def test_bootstrap_source_is_the_documented_cell():
    assert bootstrap_source(REPO_URL) == EXPECTED_SOURCE
    cell = bootstrap_cell(REPO_URL)
    assert cell.cell_type == "code" and cell.source == EXPECTED_SOURCE and cell.outputs == []


def test_bootstrap_rejects_something_that_is_not_a_url():
    with pytest.raises(ValueError, match="repository URL"):
        bootstrap_source("github.com/minillm/minillm")


def test_recognizing_the_bootstrap_cell():
    assert is_bootstrap_cell(bootstrap_cell(REPO_URL), REPO_URL)
    other = bootstrap_cell("https://example.org/elsewhere")
    assert not is_bootstrap_cell(other, REPO_URL)
    assert looks_like_bootstrap_cell(other)
    assert not looks_like_bootstrap_cell(code("import minillm"))
    assert not looks_like_bootstrap_cell(nbformat.v4.new_markdown_cell(EXPECTED_SOURCE))


def test_repository_url_reads_the_book_config(tmp_path):
    config = tmp_path / "_config.yml"
    config.write_text("title: t\nrepository:\n  url: https://example.org/a/b/\n  branch: main\n")
    assert repository_url(config) == "https://example.org/a/b"


def test_repository_url_explains_a_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"_config.yml not found.*repository: url:"):
        repository_url(tmp_path / "_config.yml")


@pytest.mark.parametrize("text", ["title: t\n", "repository:\n  branch: main\n", "repository: x\n"])
def test_repository_url_explains_a_missing_setting(tmp_path, text):
    config = tmp_path / "_config.yml"
    config.write_text(text)
    with pytest.raises(ValueError, match="no `repository: url:` setting"):
        repository_url(config)


def test_the_cell_is_a_no_op_with_minillm_and_installs_without_it(tmp_path):
    cell = bootstrap_cell(REPO_URL)
    nb = nbformat.v4.new_notebook(cells=[cell, code(FAKE_COLAB), bootstrap_cell(REPO_URL)])
    errors = execute_notebook(nb, tmp_path, timeout_s=60)
    assert errors == {0: None, 1: None, 2: None}
    assert nb.cells[0].outputs == []
    [output] = nb.cells[2].outputs
    assert output.text == f'pip install --quiet "minillm[book] @ git+{REPO_URL}"\n'
