"""`LLM`: offline inference in three lines, with vLLM's API.

    llm = LLM()                                   # the bundled model, or any HF directory
    outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)

`generate` queues every prompt and steps the engine until all are done, so the prompts are
batched continuously; `stream` yields one prompt's output as its tokens arrive.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from minillm.engine.llm_engine import EngineArgs, LLMEngine
from minillm.model.tokenizer import Tokenizer
from minillm.outputs import RequestOutput
from minillm.sampling_params import SamplingParams

Prompt = str | list[int]  # text, or token ids


class LLM:
    """A model and an engine around it; options are EngineArgs fields (block_size=...)."""

    def __init__(self, model: str | os.PathLike | None = None, **engine_args) -> None:
        args = EngineArgs(**engine_args) if model is None else EngineArgs(model, **engine_args)
        self.engine = LLMEngine(args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; returns their outputs in the order of the prompts.

        sampling_params: one for all prompts, or one per prompt (default SamplingParams()).
        priority: one value per prompt, for an engine with scheduling_policy="priority"
        (lower values first).
        """
        prompts = as_prompt_list(prompts)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                    "give one for all or one per prompt"
                )
        request_ids = self._add_requests(prompts, params_list, priorities)
        return self._run_until_finished(request_ids, use_tqdm)

    def _add_requests(
        self, prompts: list[Prompt], params_list: list[SamplingParams], priorities: list[int]
    ) -> list[str]:
        """Queue all prompts, or none: a bad prompt withdraws the ones queued before it."""
        request_ids: list[str] = []
        try:
            for prompt, params, priority in zip(prompts, params_list, priorities, strict=True):
                request_id = str(next(self._request_counter))
                self.engine.add_request(request_id, prompt, params, priority=priority)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def _run_until_finished(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the prompt's output after every step that adds to it; the new text of each
        completion is in `outputs[i].delta_text`. Closing the iterator early aborts the request.
        """
        request_id = str(next(self._request_counter))
        self.engine.add_request(request_id, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort_request(request_id)


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or a list of token ids) or a sequence of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt of token ids
    return prompts
