"""The course tooling: exercise release, grading, the Colab bootstrap, notebook generation
and the book's glue."""
