"""One bundled model for the server tests, and offline references computed on it.

The server owns its engine while it runs, so references (`LLM.generate`, greedy) are
computed before a server starts on the same `LLM`, or on `reference_llm`, a second copy.
"""

from __future__ import annotations

import pytest

from minillm import LLM, SamplingParams

# small enough for 2 loaded cores, big enough for several requests at once
ENGINE_OPTIONS = {"max_model_len": 256, "max_num_seqs": 8, "stats_window": 16}


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(**ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def reference_llm() -> LLM:
    """A second engine on the same model: offline references while a server runs."""
    return LLM(**ENGINE_OPTIONS)


def greedy(llm: LLM, prompts: list, max_tokens: int, **options) -> list[str]:
    """The offline greedy texts of `prompts` (text or token ids)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **options)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def pool_is_empty(engine) -> bool:
    """No request holds a KV block or a batch seat (cached free blocks count as free)."""
    return (
        engine.kv_cache_manager.usage == 0.0
        and not engine.scheduler.running
        and not engine.scheduler.waiting
        and not engine.output_processor.states
    )
