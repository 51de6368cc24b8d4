"""`glue` for the chapter pages: myst-nb's where it is installed, a stand-in elsewhere.

A chapter puts the numbers its code computes into its prose with `glue(name, value)` and a
`{glue:text}` role. myst-nb, which provides both, belongs to the book build, not to
minillm's own dependencies: on Colab a chapter runs from a pip-installed minillm without
it, and Jupyter shows the roles as plain text anyway. There `glue` keeps each value in
`glued` and displays it only when asked, as myst-nb's does.
"""

from __future__ import annotations

from typing import Any

try:
    from myst_nb import glue
except ImportError:  # outside the book build, e.g. on Colab
    glued: dict[str, Any] = {}

    def glue(name: str, variable: Any, display: bool = True) -> None:
        """Keep `variable` as `glued[name]`; show it too when `display`."""
        glued[name] = variable
        if display:
            from IPython.display import display as show

            show(variable)


__all__ = ["glue"]
