"""What the pages of chapter 3 (the KV cache) share: engines over the bundled model and prompts.

Each page of the book runs in a fresh kernel, so the chapter's three pages import these
instead of redefining them:

- `make_engine(**kwargs)`: an `LLMEngine` over the bundled model with vLLM-named options;
- `stdlib_prompts(num, min_lines, max_lines, seed)`: real code as prompts, runs of
  consecutive lines of a few standard-library modules, the same list for the same seed;
- `snippet(tokenizer, token_ids)`: a few characters of what some tokens say, for a label.
"""

from __future__ import annotations

import bisect
import calendar
import fractions
import heapq
import pathlib
import random
import textwrap
from collections.abc import Sequence
from typing import Protocol

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.model.loader import DEFAULT_MODEL

MODEL = DEFAULT_MODEL  # the bundled model, trained on Python's standard library
PROMPT_SOURCES = (bisect, calendar, fractions, heapq, textwrap)


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


def make_engine(**kwargs) -> LLMEngine:
    """An engine over the bundled model; kwargs are EngineArgs options (vLLM's names)."""
    return LLMEngine(EngineArgs(model=MODEL, **kwargs))


def stdlib_prompts(num: int, min_lines: int, max_lines: int, seed: int) -> list[str]:
    """Real code as prompts: runs of consecutive lines from a few standard-library modules.

    Each prompt is `min_lines` to `max_lines` consecutive lines of one module in
    `PROMPT_SOURCES`, trailing whitespace removed; runs that are only whitespace are skipped.
    """
    if not 1 <= min_lines <= max_lines:
        raise ValueError(f"need 1 <= min_lines <= max_lines, got {min_lines} and {max_lines}")
    rng = random.Random(seed)
    sources = [pathlib.Path(m.__file__).read_text().splitlines() for m in PROMPT_SOURCES]
    prompts = []
    while len(prompts) < num:
        lines = rng.choice(sources)
        start = rng.randrange(len(lines) - max_lines)
        text = "\n".join(lines[start : start + rng.randint(min_lines, max_lines)]).rstrip()
        if text.strip():
            prompts.append(text)
    return prompts


def snippet(tokenizer: Decoder, token_ids: Sequence[int], num_chars: int = 12) -> str:
    """A few characters of the text of `token_ids`, quoted, newlines shown as ⏎."""
    text = " ".join(tokenizer.decode(list(token_ids)).replace("\n", "⏎").split())
    return repr(text[:num_chars] + ("…" if len(text) > num_chars else ""))
