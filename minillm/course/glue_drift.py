"""Which words of the prose changed between builds of the book.

The book's numbers come from code through `glue`, and so do the words that state a
claim about them ("above" or "not above", "the time gain is the smaller", "later"): a page
picks the word from its own measurement. A claim that holds only in some builds is a
claim the prose should not make. This compares the text values glued by two or more
built books (each build's `_build/jupyter_execute/**/*.glue.json`, which myst-nb writes
when it executes a page) and lists every key whose words differ. Numbers are left out:
they move with the machine's load; the words must not.

Keys are compared per chapter (the first two characters of a page's name), so a glue key
that moved to another page of its chapter still compares.

A key whose name ends in `_outcome` reports what one run did rather than claim something
about it: the verdict of a deliberately noisy A/B test, whether a fresh engine's first call
was the slower. Its page words the prose for every value it can take, so such keys are
listed apart and do not count as drift.

    python -m minillm.course.glue_drift BUILD_DIR BUILD_DIR [BUILD_DIR ...]

BUILD_DIR is a book's build output (the folder holding `jupyter_execute`, usually
`_build`, or `--path-output`'s folder with `_build` inside). Exit status 1 when a claim
differs.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
from collections.abc import Sequence


def _execute_dir(build: pathlib.Path) -> pathlib.Path:
    for candidate in (build / "jupyter_execute", build / "_build" / "jupyter_execute"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no jupyter_execute folder in {build} (or {build}/_build)")


def text_glues(build: str | pathlib.Path) -> dict[tuple[str, str], str]:
    """{(chapter, key): text} for every glued value of a build that is a string."""
    found: dict[tuple[str, str], str] = {}
    for path in sorted(_execute_dir(pathlib.Path(build)).rglob("*.glue.json")):
        chapter = path.name[:2]
        for key, output in json.loads(path.read_text(encoding="utf-8")).items():
            plain = output.get("data", {}).get("text/plain") if isinstance(output, dict) else None
            if not isinstance(plain, str):
                continue
            try:
                value = ast.literal_eval(plain)
            except (ValueError, SyntaxError):
                continue  # a repr that is not a literal: not text the prose reads
            if isinstance(value, str):
                found[chapter, key] = value
    return found


OUTCOME_SUFFIX = "_outcome"
_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_LIST = re.compile(r"#(?:(?:, | and | to |–)#)+")


def words(text: str) -> str:
    """The text with every number, and every list or range of numbers, replaced by #: what
    must not change between builds."""
    return _NUMBER_LIST.sub("#", _NUMBER.sub("#", text))


def is_outcome(key: str) -> bool:
    return key.endswith(OUTCOME_SUFFIX)


def drift(
    builds: Sequence[str | pathlib.Path], outcomes: bool = False
) -> dict[tuple[str, str], list[str]]:
    """{(chapter, key): the text in each build} for the keys in every build whose words
    differ between builds: the claims, or with outcomes=True the `_outcome` keys."""
    if len(builds) < 2:
        raise ValueError(f"compare at least two builds, got {len(builds)}")
    values = [text_glues(b) for b in builds]
    keys = set().union(*values)
    return {
        key: [v[key] for v in values]
        for key in sorted(keys)
        if is_outcome(key[1]) == outcomes
        and all(key in v for v in values)
        and len({words(v[key]) for v in values}) > 1
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", type=pathlib.Path)
    args = parser.parse_args(argv)
    changed = drift(args.builds)
    varied = drift(args.builds, outcomes=True)
    counts = [len(text_glues(b)) for b in args.builds]
    print(
        f"text glued per build: {counts}; claims whose words differ: {len(changed)}; "
        f"outcomes that differ (worded for every value): {len(varied)}"
    )
    for title, found in (("claim", changed), ("outcome", varied)):
        for (chapter, key), texts in found.items():
            print(f"{title}, chapter {chapter}, {key}:")
            for build, text in zip(args.builds, texts, strict=True):
                print(f"    {build}: {text!r}")
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
