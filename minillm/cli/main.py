"""The `minillm` command: one subcommand per module, imported only when it runs.

Each module listed in SUBCOMMANDS has `add_parser(subparsers)`, which adds its subcommand
and sets `func` to a handler `func(args) -> int` (the exit status). `minillm --help` lists
the subcommands from this table without importing any of them, and `minillm generate`
imports the engine alone, none of the notebook or grading tooling.

A user error (a bad option value, a missing or corrupt model file) prints one line on stderr
and exits with status 2; a traceback means a bug in minillm.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_parser, one-line help shown by `minillm --help`)
SUBCOMMANDS = {
    "generate": ("minillm.cli.generate", "complete prompts with a model"),
    "serve": ("minillm.cli.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "router": ("minillm.cli.router", "route requests over several minillm serve replicas"),
    "bench": ("minillm.lab.bench", "benchmarks (speed is measured, never asserted)"),
    "eval": ("minillm.cli.eval", "measure a model: perplexity, weight bytes"),
    "exercises": (
        "minillm.course.exercises",
        "release exercise notebooks from their solutions, or check them",
    ),
    "grade": ("minillm.course.grading", "grade exercise notebooks against the reference checks"),
    "notebooks": (
        "minillm.course.notebooks",
        "regenerate book/*.ipynb (for Colab) from the book/*.md sources",
    ),
}

# what a user can get wrong: values, files, missing packages; anything else is a bug
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (None: none of them)."""
    parser = argparse.ArgumentParser(
        prog="minillm", description="minillm: a small LLM inference engine and its textbook."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args))
    except USER_ERRORS as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"minillm {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"minillm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
