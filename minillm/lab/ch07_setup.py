"""What every page of chapter 7 (sampling, speculative and constrained decoding) starts from.

The chapter is three pages (`book/07_decoding.md`, `07_decoding_speculative.md`,
`07_decoding_constrained.md`), and Jupyter Book runs each in a fresh kernel. Each page's
hidden setup cell calls `start_page`, which applies the house style, seeds torch and runs it
on one thread (steadier timings when other programs share the cores), and builds the
bundled target's engine and tokenizer that the page's cells use. The first page quotes the
exercises' points in its front matter and the last page describes the exercises, so both
count them with `exercise_points`.
"""

from __future__ import annotations

import torch

from minillm import LLM
from minillm.lab.exercise_count import exercise_points  # noqa: F401  (the pages' name)
from minillm.lab.figures import use_house_style
from minillm.model.tokenizer import Tokenizer

TARGET = "minillm-stdlib-target"
DRAFT = "minillm-stdlib-draft"  # the smaller model trained beside the target, same tokenizer


def start_page(seed: int = 0) -> tuple[LLM, Tokenizer]:
    """House style, torch seeded and on one thread; the bundled target's engine and tokenizer."""
    use_house_style()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    llm = LLM(TARGET)
    return llm, llm.get_tokenizer()
