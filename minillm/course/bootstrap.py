"""The first cell of every notebook: install minillm where it is missing (Colab).

Every notebook the project ships (exercises, solutions, and the Colab copies of the
chapters) starts with the same code cell. On a machine where `minillm` imports, the
cell does nothing. Where it does not (a fresh Colab runtime), it installs the project
from its repository with pip's direct-reference form, `minillm[book] @ git+<url>` (the
engine and what the chapters and exercises need to run), without constraints, so that
Colab keeps its own CUDA build of torch.

The repository URL has one home: `repository: url:` in the book's `_config.yml`, which
also drives the book's repository button and Colab links. The `%pip` line sits inside
the `except` branch; IPython transforms indented line magics like any other line, so
the cell is valid in a kernel (and only there: it is not plain Python).
"""

from __future__ import annotations

import os
import pathlib

import nbformat

BOOTSTRAP_COMMENT = (
    "# Setup: installs minillm when it is not importable (e.g. on Colab); otherwise does nothing."
)


def bootstrap_source(repo_url: str) -> str:
    """The source of the bootstrap cell for the repository at `repo_url`."""
    if not repo_url.startswith(("https://", "http://", "ssh://", "file://")):
        raise ValueError(
            f"expected a repository URL such as https://github.com/o/r, got {repo_url!r}"
        )
    return (
        f"{BOOTSTRAP_COMMENT}\n"
        "try:\n"
        "    import minillm  # noqa: F401\n"
        "except ImportError:\n"
        f'    %pip install --quiet "minillm[book] @ git+{repo_url}"'
    )


def bootstrap_cell(repo_url: str) -> nbformat.NotebookNode:
    """The bootstrap as a new code cell (no outputs, no metadata)."""
    return nbformat.v4.new_code_cell(bootstrap_source(repo_url))


def is_bootstrap_cell(cell: nbformat.NotebookNode, repo_url: str) -> bool:
    """True when `cell` is exactly the bootstrap cell for `repo_url`."""
    return cell.cell_type == "code" and cell.source == bootstrap_source(repo_url)


def looks_like_bootstrap_cell(cell: nbformat.NotebookNode) -> bool:
    """True for a bootstrap cell of any URL or version (it starts with the setup comment)."""
    return cell.cell_type == "code" and cell.source.startswith(BOOTSTRAP_COMMENT)


def repository_url(config_path: str | os.PathLike[str]) -> str:
    """The `repository: url:` of the book's `_config.yml` at `config_path`."""
    import yaml  # installed with jupyter-book; needed only by the tools that write notebooks

    path = pathlib.Path(config_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the bootstrap cell takes the repository URL from "
            "`repository: url:` in the book's _config.yml"
        )
    config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    repository = config.get("repository") if isinstance(config, dict) else None
    url = repository.get("url") if isinstance(repository, dict) else None
    if not isinstance(url, str) or not url:
        raise ValueError(f"{path} has no `repository: url:` setting (a string) for the bootstrap")
    return url.rstrip("/")
