"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's `vllm.lora.request` class).

A request without one runs on the base model alone. The engine loads an adapter the first
time a request names it (by `lora_int_id`) and keeps it beside the base weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# the runner keeps each token's adapter id in an int64 tensor
MAX_LORA_INT_ID = 2**63 - 1


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique to it, and its PEFT directory.

    lora_path: a directory holding `adapter_config.json` and `adapter_model.safetensors`,
    the layout PEFT's `save_pretrained` writes.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str | os.PathLike = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or not 1 <= self.lora_int_id <= MAX_LORA_INT_ID
        ):
            raise ValueError(
                f"lora_int_id must be an int in [1, {MAX_LORA_INT_ID}], got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str | os.PathLike) or not str(self.lora_path):
            raise ValueError(f"lora_path must be the adapter's directory, got {self.lora_path!r}")
