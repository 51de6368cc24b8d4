"""Written by `minillm exercises release`: pytest --nbval-lax names each graded cell
"Exercise N", as the notebook's headings and `minillm grade` do."""

from minillm.course.nbval_names import pytest_collection_modifyitems  # noqa: F401
