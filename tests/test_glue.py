"""minillm.course.glue: myst-nb's glue in the book build, a stand-in where myst-nb is missing."""

import subprocess
import sys

import myst_nb

from minillm.course import glue as glue_module


def test_the_book_build_uses_myst_nb():
    assert glue_module.glue is myst_nb.glue


def test_without_myst_nb_values_are_kept_and_shown_only_when_asked():
    code = (
        "import sys\n"
        "sys.modules['myst_nb'] = None  # as on Colab: not installed\n"
        "from minillm.course.glue import glue, glued\n"
        "glue('hidden', 41, display=False)\n"
        "glue('shown', 'forty-two')\n"
        "print(glued)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    # outside a kernel IPython's display prints the value
    assert result.stdout.splitlines() == ["forty-two", "{'hidden': 41, 'shown': 'forty-two'}"]
