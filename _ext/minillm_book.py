"""Sphinx additions for the minillm book, loaded by _config.yml (local_extensions).

- Each script is written once per page: sphinx-thebe registers its configuration script
  every time the environment is read, and a page that declares `const THEBE_JS_URL` twice
  logs a SyntaxError in the reader's console.
- Math renders offline: MathJax 3 is served from the book's own `_static/mathjax/` (the files
  of the `sphinx-mathjax-offline` package), not from a CDN, so a reader who opens
  `_build/html` with the network off still sees every equation typeset.
"""

from __future__ import annotations

import importlib.util
import pathlib

from sphinx.util.fileutil import copy_asset

# the package's module name has dashes, so it is found by spec rather than imported
MATHJAX_PACKAGE = "sphinx-mathjax-offline"


def _mathjax_dir() -> pathlib.Path:
    spec = importlib.util.find_spec(MATHJAX_PACKAGE)
    if spec is None or spec.origin is None:
        raise ImportError(
            f"the book serves MathJax itself and needs the {MATHJAX_PACKAGE} package "
            "(pip install -e '.[docs]')"
        )
    return pathlib.Path(spec.origin).parent / "static" / "mathjax"


def _use_local_mathjax(app, config):
    _mathjax_dir()  # fail at the start of the build, not after every page has run
    config.mathjax_path = "mathjax/tex-chtml.js"


def _copy_mathjax(app, exception):
    if exception is None and app.builder.format == "html":
        copy_asset(str(_mathjax_dir()), str(pathlib.Path(app.outdir) / "_static" / "mathjax"))


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        # the same file, or the same inline body, whatever its priority
        attributes = getattr(script, "attributes", {}) or {}
        # an inline script is registered with filename None once and "" the next time
        filename = getattr(script, "filename", str(script)) or ""
        key = (filename, str(attributes.get("body", "")))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique


def setup(app):
    # early: html-page-context stops at the first handler that returns a template name
    app.connect("html-page-context", _dedupe_scripts, priority=100)
    app.connect("config-inited", _use_local_mathjax)
    app.connect("build-finished", _copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
