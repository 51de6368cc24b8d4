"""What a chapter asks of a reader, computed: reading time, exercise time, points, goals.

The instructor's guide (`book/instructors.md`) reads its table from here:

- reading time from the chapter source's word count (prose only: no front matter, no
  code cells) at `WORDS_PER_MINUTE`: a lower bound, since it leaves out running the code;
- the authors' estimates of reading-and-running and exercise time, from the chapter's
  "**Time.**" line;
- the checks' machine time from a measured run of the chapter's solution notebook,
  recorded in `book/data/solution_times.json` with the machine, the date and the load
  average it ran under;
- points from the solution's `# GRADED: N points` markers;
- learning goals and prerequisites from the chapter's opening paragraphs.

`python -m minillm.course.timing` runs every notebook in `solutions/` and rewrites the
data file; `python -m minillm.course.timing ch03_kv_cache` times one and keeps the rest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import re
import time

from minillm.course.notebook_io import execute_notebook, graded_cells, read_notebook

WORDS_PER_MINUTE = 200  # a careful reading pace for technical prose with formulas
TIMES_FILE = pathlib.Path("book") / "data" / "solution_times.json"

_FRONT_MATTER = re.compile(r"\A---\n.*?\n---\n", re.DOTALL)
_CODE_CELL = re.compile(r"^```\{code-cell\}.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'’.\-]*")


def prose(md_text: str) -> str:
    """A MyST page's text without its front matter and code cells."""
    return _CODE_CELL.sub("", _FRONT_MATTER.sub("", md_text, count=1))


def word_count(md_text: str) -> int:
    """Words of prose a reader reads: runs of letters and digits outside code cells."""
    return len(_WORD.findall(prose(md_text)))


def reading_minutes(md_text: str | list[str], words_per_minute: int = WORDS_PER_MINUTE) -> int:
    """Minutes to read a page, or a chapter's pages, at `words_per_minute`, rounded up to
    the next 5."""
    if words_per_minute <= 0:
        raise ValueError(f"words_per_minute must be positive, got {words_per_minute}")
    minutes = chapter_word_count(md_text) / words_per_minute
    return max(5, 5 * math.ceil(minutes / 5))


def chapter_word_count(pages: str | list[str]) -> int:
    """Words of prose of one page, or of a chapter split into pages (each with its own
    front matter)."""
    return word_count(pages) if isinstance(pages, str) else sum(map(word_count, pages))


_AUTHORS_TIME = re.compile(
    r"\*\*Time\.\*\*\s+About\s+(\d+)\s+(minutes?|hours?)\s+to\s+read\s+and\s+run,?\s+"
    r"and\s+(\d+)\s+(minutes?|hours?)\s+for\s+the\s+exercises"
)


def authors_minutes(md_text: str) -> tuple[int, int] | None:
    """The chapter's own "**Time.**" estimate: (minutes to read and run, minutes for the
    exercises), or None when it states none."""
    match = _AUTHORS_TIME.search(md_text)
    if match is None:
        return None
    read, read_unit, exercises, exercises_unit = match.groups()
    return (
        int(read) * (60 if read_unit.startswith("hour") else 1),
        int(exercises) * (60 if exercises_unit.startswith("hour") else 1),
    )


def _paragraph_after(md_text: str, label: str) -> str:
    start = md_text.find(f"**{label}.**")
    if start < 0:
        return ""
    rest = md_text[start + len(label) + 5 :]
    return rest.split("\n\n", 1)[0].strip()


def prerequisites(md_text: str) -> str:
    """The chapter's "**Prerequisites.**" paragraph, on one line; "" if it has none."""
    return " ".join(_paragraph_after(md_text, "Prerequisites").split())


def learning_goals(md_text: str) -> list[str]:
    """The bullets under the chapter's "**Learning goals.**" paragraph, each on one line."""
    start = md_text.find("**Learning goals.**")
    if start < 0:
        return []
    goals: list[str] = []
    for block in md_text[start:].split("\n\n")[1:]:
        if not block.lstrip().startswith("- "):
            break
        for item in re.split(r"^- ", block.strip(), flags=re.MULTILINE):
            if item.strip():
                goals.append(" ".join(item.split()).rstrip(";."))
        break
    return goals


_ROLE = re.compile(r"\{[a-z:]+\}`([^`]*)`")


def plain(myst: str) -> str:
    """MyST roles reduced to their text: {term}`KV cache` -> KV cache, {ref}`a <b>` -> a."""

    def text(match: re.Match) -> str:
        inner = match.group(1)
        role = match.group(0)
        if role.startswith("{glue") or (role.startswith("{ref") and "<" not in inner):
            return ""
        return re.sub(r"\s*<[^>]*>$", "", inner).lstrip("~")

    return re.sub(r"\s*\((?:[\s,]|and)*\)", "", _ROLE.sub(text, myst)).strip()


def title(md_text: str) -> str:
    """The page's first level-1 heading."""
    match = re.search(r"^# (.+)$", prose(md_text), flags=re.MULTILINE)
    return match.group(1).strip() if match else ""


def solution_points(path: str | os.PathLike[str]) -> int:
    """Points of a solution notebook: the sum of its `# GRADED: N points` markers."""
    return sum(graded_cells(read_notebook(path)).values())


def machine() -> dict:
    """Where a measurement ran: the CPU's model name, core count and Python version."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": name, "cpu_count": os.cpu_count(), "python": platform.python_version()}


def time_solution(path: pathlib.Path, timeout_s: int = 900) -> dict:
    """Run one solution notebook in a fresh kernel; its wall time, failed cells, and the
    machine's 1-minute load average as the run started (a shared machine runs slower
    under load, so a time is read beside it)."""
    nb = read_notebook(path)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    errors = execute_notebook(nb, path.resolve().parent, timeout_s)
    seconds = time.perf_counter() - start
    failed = sorted(i for i, e in errors.items() if e is not None)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {
        "seconds": round(seconds, 1),
        "failed_cells": failed,
        "date": date,
        "load_1m": round(load, 2),
    }


def load_times(root: pathlib.Path) -> dict:
    """The recorded solution times, or {} when the file is not there (a Colab copy)."""
    path = root / TIMES_FILE
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def record_times(root: pathlib.Path, names: list[str] | None = None) -> dict:
    """Time the named solutions (all when None) and write them into the data file."""
    paths = sorted((root / "solutions").glob("*.ipynb"))
    if names:
        wanted = {n.removesuffix(".ipynb") for n in names}
        unknown = wanted - {p.stem for p in paths}
        if unknown:
            raise ValueError(f"no solution notebook named {sorted(unknown)} in solutions/")
        paths = [p for p in paths if p.stem in wanted]
    data = load_times(root) if names else {}
    notebooks = dict(data.get("notebooks", {}))
    for path in paths:
        notebooks[path.stem] = time_solution(path)
        print(f"{path.stem}: {notebooks[path.stem]['seconds']} s", flush=True)
    data = {
        "what": "wall seconds of one run of each solution notebook, in a fresh kernel",
        "command": "python -m minillm.course.timing",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "notebooks": dict(sorted(notebooks.items())),
    }
    if "class_grading" in load_times(root):  # measured separately (see the guide)
        data["class_grading"] = load_times(root)["class_grading"]
    out = root / TIMES_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("names", nargs="*", help="solution notebooks to time (default: all)")
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path.cwd())
    args = parser.parse_args(argv)
    record_times(args.root, args.names or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
