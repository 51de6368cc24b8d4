"""`SpeculativeConfig`: what `LLM(model, speculative_config={...})` accepts, checked on entry.

The keys are vLLM's (`vllm.config.SpeculativeConfig`, v0.11): `method`, `model`,
`num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`. minillm implements two
methods, "draft_model" (a smaller model of the same vocabulary proposes) and "ngram" (prompt
lookup); vLLM's other methods ("eagle", "eagle3", "medusa", "mtp", ...) need trained heads and
are refused with a ValueError that says so. As in vLLM, a `model` without a `method` means
"draft_model", and `model="ngram"` means the n-gram method; for n-gram, a missing
prompt_lookup_min or prompt_lookup_max takes the other's value, and both default to 5.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

SPEC_METHODS = ("draft_model", "ngram")
# vLLM's other methods: named so that the error can say they exist but are not implemented here
OTHER_VLLM_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp")
SPEC_CONFIG_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
)
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A checked speculative-decoding configuration."""

    method: str
    num_speculative_tokens: int
    model: str | os.PathLike | None = None  # the draft model (method "draft_model")
    prompt_lookup_min: int | None = None  # method "ngram": shortest n-gram matched
    prompt_lookup_max: int | None = None  # method "ngram": longest n-gram matched

    @classmethod
    def from_value(cls, value: object) -> SpeculativeConfig:
        """A SpeculativeConfig from vLLM's dict (or one already made). Raises ValueError naming
        the key at fault."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative_config must be a dict such as "
                f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {value!r:.80}'
            )
        unknown = sorted(set(value) - set(SPEC_CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; minillm accepts {SPEC_CONFIG_KEYS}"
            )
        method = value.get("method")
        model = value.get("model")
        if method is None:
            if model is None:
                raise ValueError(
                    'speculative_config needs a "method" ("draft_model" or "ngram") or a "model"'
                )
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method in OTHER_VLLM_METHODS:
            raise ValueError(
                f"speculative_config method {method!r} is one of vLLM's, but minillm implements "
                f"only {SPEC_METHODS}"
            )
        if method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {SPEC_METHODS}, got {method!r}"
            )
        k = value.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config needs num_speculative_tokens (an int >= 1)")
        _check_int("num_speculative_tokens", k, 1)
        lookup_min = value.get("prompt_lookup_min")
        lookup_max = value.get("prompt_lookup_max")
        if method == "draft_model":
            if model is None:
                raise ValueError(
                    'speculative_config method "draft_model" needs "model": a draft model '
                    "directory or a bundled model's name, such as 'minillm-stdlib-draft'"
                )
            if not isinstance(model, (str, os.PathLike)):
                raise ValueError(f"speculative_config model must be a str or path, got {model!r}")
            if lookup_min is not None or lookup_max is not None:
                raise ValueError(
                    "prompt_lookup_min and prompt_lookup_max apply only to method 'ngram'"
                )
            return cls(method, k, model=model)
        if model not in (None, "ngram", "[ngram]"):
            raise ValueError(f"method 'ngram' takes no draft model, got model={model!r}")
        for name, bound in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if bound is not None:
                _check_int(name, bound, 1)
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        if lookup_min > lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max ({lookup_max})"
            )
        return cls(method, k, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max)

    def check_draft_config(self, target_vocab_size: int, max_model_len: int) -> None:
        """method "draft_model": the draft must exist, share the target's vocabulary and hold
        max_model_len positions (reads the draft's config.json, loads nothing)."""
        if self.method != "draft_model":
            return
        from minillm.model.loader import resolve_model_path

        path = pathlib.Path(resolve_model_path(self.model))
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"speculative_config model {self.model!r} has no config.json")
        draft_config = json.loads(config_file.read_text())
        draft_vocab_size = draft_config.get("vocab_size")
        if draft_vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab_size} tokens) must equal the "
                f"target's ({target_vocab_size}): draft and target must share a tokenizer"
            )
        draft_positions = draft_config.get("max_position_embeddings", 0)
        if draft_positions < max_model_len:
            raise ValueError(
                f"the draft model holds {draft_positions} positions, fewer than "
                f"max_model_len={max_model_len}; give a smaller max_model_len"
            )


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config {name} must be an int >= {minimum}, got {value!r}")
