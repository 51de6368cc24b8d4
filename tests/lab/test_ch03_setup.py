"""The shared setup of chapter 3's pages: engines over the bundled model, prompts, snippets."""

from __future__ import annotations

import pathlib

import pytest

from minillm.lab.ch03_setup import MODEL, PROMPT_SOURCES, make_engine, snippet, stdlib_prompts
from minillm.model.loader import DEFAULT_MODEL
from minillm.sampling_params import SamplingParams

SOURCES = [pathlib.Path(m.__file__).read_text().splitlines() for m in PROMPT_SOURCES]


def is_run_of_source_lines(prompt: str) -> bool:
    """True when the prompt's lines are consecutive lines of one source module."""
    lines = prompt.split("\n")
    for source in SOURCES:
        for start in range(len(source) - len(lines) + 1):
            window = source[start : start + len(lines)]
            if window[:-1] == lines[:-1] and window[-1].rstrip() == lines[-1]:
                return True
    return False


def test_prompts_are_runs_of_consecutive_standard_library_lines():
    prompts = stdlib_prompts(12, 2, 30, seed=1)
    assert len(prompts) == 12
    for prompt in prompts:
        assert prompt.strip() and prompt == prompt.rstrip()
        # rstrip may drop trailing blank lines, never add any
        assert 1 <= len(prompt.split("\n")) <= 30
        assert is_run_of_source_lines(prompt)


def test_prompts_repeat_for_a_seed_and_differ_between_seeds():
    assert stdlib_prompts(5, 6, 10, seed=11) == stdlib_prompts(5, 6, 10, seed=11)
    assert stdlib_prompts(5, 6, 10, seed=11) != stdlib_prompts(5, 6, 10, seed=12)
    # a longer list starts with the shorter one: the pages may ask for a few more
    assert stdlib_prompts(8, 1, 2, seed=7)[:3] == stdlib_prompts(3, 1, 2, seed=7)


def test_prompt_lengths_follow_the_bounds():
    one_liners = stdlib_prompts(20, 1, 1, seed=3)
    assert all("\n" not in p for p in one_liners)
    long_ones = stdlib_prompts(20, 8, 10, seed=3)
    assert max(len(p.split("\n")) for p in long_ones) > 1


@pytest.mark.parametrize("bounds", [(0, 3), (5, 4)])
def test_prompts_refuse_bounds_that_select_nothing(bounds):
    with pytest.raises(ValueError, match="min_lines"):
        stdlib_prompts(1, *bounds, seed=0)


class Text:
    """A stand-in tokenizer whose tokens are characters."""

    def decode(self, token_ids):
        return "".join(chr(t) for t in token_ids)


def ids(text):
    return [ord(c) for c in text]


def test_a_snippet_quotes_the_start_and_marks_what_it_cut():
    assert snippet(Text(), ids("def f(x):\n    return x")) == repr("def f(x):⏎ r…")
    assert snippet(Text(), ids("short")) == "'short'"
    assert snippet(Text(), ids("abcdefghij"), num_chars=4) == "'abcd…'"
    # runs of spaces collapse to one, so indentation does not fill the label
    assert snippet(Text(), ids("a      b"), num_chars=12) == "'a b'"


def test_make_engine_runs_the_bundled_model_with_the_options_given():
    assert MODEL == DEFAULT_MODEL
    engine = make_engine(max_model_len=128, num_gpu_blocks=16, block_size=16)
    assert engine.kv_cache_manager.block_pool.num_blocks == 16
    assert engine.max_model_len == 128
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=3))
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
    assert len(tokens) == 3
