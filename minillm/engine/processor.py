"""Input processing: a request as the caller gives it, checked and turned into token ids.

Everything `LLMEngine.add_request` is handed passes through here before anything is queued:
the prompt (text, token ids, or vLLM's prompt dicts) becomes token ids, and every value the
engine could not serve is refused with a ValueError that names it, so that a bad request
never reaches the scheduler and the requests in flight carry on. `SamplingParams` checks what
it can alone; this module checks what depends on the model and on the engine (the
vocabulary, max_model_len, max_num_seqs, speculative decoding, worker processes, LoRA).

vLLM V1 has the same split: `vllm/v1/engine/processor.py` (`Processor.process_inputs`) turns
a prompt and its parameters into an `EngineCoreRequest` before the engine core sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from minillm.lora.request import LoRARequest
from minillm.model.lora import LoRAManager
from minillm.sampling_params import SamplingParams
from minillm.spec.spec_runner import unsupported_with_spec_decode

# a prompt: text, token ids, or vLLM's dicts {"prompt": text} / {"prompt_token_ids": ids}
Prompt = str | list[int] | Mapping[str, object]


@dataclass
class Processor:
    """The checks of one engine's requests, with the limits they are checked against."""

    tokenizer: object  # encode(text) -> list[int]
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    scheduling_policy: str
    spec_decode: bool = False  # speculative decoding is on (some options are refused)
    multiprocess: bool = False  # worker processes run the model (structured outputs are not)
    lora_manager: LoRAManager | None = None

    def process(
        self,
        request_id: object,
        prompt: Prompt,
        params: SamplingParams | None,
        priority: object,
    ) -> tuple[str | None, list[int], SamplingParams]:
        """The prompt's text (None for token ids), its token ids, and the params (the
        defaults when None); ValueError for anything this engine cannot serve."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority={priority} needs scheduling_policy='priority', "
                f"this engine uses {self.scheduling_policy!r}"
            )
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        self.check_prompt(prompt_token_ids)
        self.check_params(params)
        return prompt_text, prompt_token_ids, params

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The prompt's text (None when given as token ids) and its token ids."""
        if isinstance(prompt, Mapping):
            keys = set(prompt) - {"multi_modal_data", "mm_processor_kwargs"}
            if keys == {"prompt"}:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise ValueError(f'{{"prompt": ...}} must hold a str, got {prompt!r:.80}')
            elif keys == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, list):
                    raise ValueError(
                        f'{{"prompt_token_ids": ...}} must hold a list of ints, got {prompt!r:.80}'
                    )
            else:
                raise ValueError(
                    'a prompt dict needs exactly one of "prompt" (text) or "prompt_token_ids", '
                    f"got the keys {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a str, a list of token ids or a prompt dict, got {prompt!r:.80}"
        )

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """At least one token, every one in the vocabulary, and room for one output token."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: expected at least one token")
        vocab_size = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids must be in [0, {vocab_size}) for this model, got {bad[:5]}"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len="
                f"{self.max_model_len} leaves room for at most {self.max_model_len - 1} "
                "prompt tokens and one output token"
            )

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: values that depend on the model."""
        vocab_size = self.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids must be in [0, {vocab_size}) for this model, got {bad[:5]}"
            )
        if self.spec_decode:
            reason = unsupported_with_spec_decode(params)
            if reason is not None:
                raise ValueError(reason)
        if params.structured_outputs is not None and self.multiprocess:
            raise ValueError(
                "structured_outputs run on one process in minillm; this engine uses "
                "tensor_parallel_size or pipeline_parallel_size > 1"
            )
        if params.n > self.max_num_seqs:
            raise ValueError(
                f"n={params.n} completions cannot run together with "
                f"max_num_seqs={self.max_num_seqs}"
            )

    def check_lora_request(self, lora_request: LoRARequest | None, in_use: set[int]) -> None:
        """A LoRARequest needs enable_lora; its adapter is loaded (and checked) now, evicting
        none of the adapters in `in_use` (the ids of the requests in flight)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}"
            )
        if self.lora_manager is None:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r} needs an engine made with "
                "enable_lora=True"
            )
        self.lora_manager.add_lora(lora_request, in_use)
