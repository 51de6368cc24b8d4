"""minillm: a small but complete LLM inference engine.

from minillm import LLM, SamplingParams
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The public API, imported on first use: `import minillm` and the `minillm` command stay fast
# until something needs the engine (and torch).
_EXPORTS = {
    "LLM": "minillm.llm",
    "SamplingParams": "minillm.sampling_params",
    "StructuredOutputsParams": "minillm.sampling_params",
    "BeamSearchParams": "minillm.sampling_params",
    "LLMEngine": "minillm.engine.llm_engine",
    "EngineArgs": "minillm.engine.args",
    "RequestOutput": "minillm.outputs",
    "CompletionOutput": "minillm.outputs",
    "LoRARequest": "minillm.lora.request",
}
__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineArgs", "RequestOutput", "CompletionOutput"]
__all__ += ["StructuredOutputsParams", "BeamSearchParams", "LoRARequest"]

if TYPE_CHECKING:
    from minillm.engine.args import EngineArgs
    from minillm.engine.llm_engine import LLMEngine
    from minillm.llm import LLM
    from minillm.lora.request import LoRARequest
    from minillm.outputs import CompletionOutput, RequestOutput
    from minillm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minillm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
