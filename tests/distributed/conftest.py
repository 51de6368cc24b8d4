"""The one-process reference every multi-process engine is compared with."""

from __future__ import annotations

import pytest

from minillm import LLM, SamplingParams

PROMPTS = [
    "Once upon a time",
    "def main(args):",
    "The quick brown fox jumps over the lazy dog and then",
    "import os",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="session")
def reference_outputs() -> list[list[int]]:
    """Greedy tokens of the bundled model in float32 on one process."""
    llm = LLM(dtype="float32", max_num_batched_tokens=32)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
