"""LoRA serving's request type (vLLM's `vllm.lora`); the adapters' math is `minillm.model.lora`."""

from minillm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
