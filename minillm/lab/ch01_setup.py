"""What both pages of chapter 1 ("A request's journey") start from.

Each page of the chapter runs in a fresh kernel, and both need the same model, the same demo
request and the count of the exercise notebook's points:

- `load_bundled_model` builds the `LLM` of `minillm-stdlib-target` in float32 and warms it
  up, so that the first timed request does not pay for the first allocations;
- `DEMO_PROMPT` and `demo_params` are the request the chapter follows;
- `exercise_points` reads the graded cells of the chapter's exercise notebook;
- `shown` writes a piece of text in a table cell as Python writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm import LLM, SamplingParams
from minillm.lab.exercise_count import exercise_points  # noqa: F401  (the pages' name)
from minillm.lab.figures import RawHTML, code
from minillm.model.config import ModelConfig
from minillm.model.tokenizer import Tokenizer

# the start of a Python function; the chapter's first page shows it as it builds the request
DEMO_PROMPT = "import os\n\n\ndef read_file(path):"
# a blank line: in the code the bundled model writes, the end of a function
DEMO_STOP = "\n\n"
DEMO_MAX_TOKENS = 64


@dataclass(slots=True)
class BundledModel:
    """The chapter's engine and the parts of it the pages look inside."""

    llm: LLM
    tokenizer: Tokenizer
    config: ModelConfig
    model: torch.nn.Module
    model_dtype: str  # as torch names it without its prefix, e.g. "float32"


def load_bundled_model() -> BundledModel:
    """The bundled model, minillm-stdlib-target (no download), computing in float32.

    Float32 because CPUs without bfloat16 matrix units emulate bfloat16 slowly (chapter 2),
    and float32 is exact here. One short request warms the engine up.
    """
    llm = LLM(dtype="float32")
    model = llm.engine.model_runner.model
    llm.generate("import sys", SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return BundledModel(
        llm=llm,
        tokenizer=llm.get_tokenizer(),
        config=llm.engine.config,
        model=model,
        model_dtype=str(model.lm_head.weight.dtype).removeprefix("torch."),
    )


def demo_params() -> SamplingParams:
    """The demo request's options: greedy, at most 64 new tokens, stop at a blank line."""
    return SamplingParams(temperature=0.0, max_tokens=DEMO_MAX_TOKENS, stop=[DEMO_STOP])


def shown(text: str) -> RawHTML:
    """A piece of text as Python writes it, so that spaces and newlines are visible."""
    return code(repr(text))
