"""The `minillm` command: one subcommand per module.

Each module listed in SUBCOMMAND_MODULES has `add_parser(subparsers)`, which adds its
subcommand and sets `func` to a handler `func(args) -> int` (the exit status). Add a
subcommand by writing that function and listing the module here. Import heavy
dependencies (torch, a kernel client) inside the handler, not at module level, so that
`minillm --help` and light subcommands stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "minillm.exercises",
    "minillm.generate",
    "minillm.grading",
    "minillm.notebooks",
    "minillm.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minillm", description="minillm: a small LLM inference engine and its textbook."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
