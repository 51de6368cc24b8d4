"""Sphinx additions for the minillm book, loaded by _config.yml (local_extensions).

- Each script is written once per page: sphinx-thebe registers its configuration script
  every time the environment is read, and a page that declares `const THEBE_JS_URL` twice
  logs a SyntaxError in the reader's console.
"""

from __future__ import annotations


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
    return {"parallel_read_safe": True, "parallel_write_safe": True}
