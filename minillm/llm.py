"""`LLM`: offline inference in three lines, with vLLM's API.

    llm = LLM()                                   # the bundled model, or any HF directory
    outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)

`generate` queues every prompt and steps the engine until all are done, so the prompts are
batched continuously; `stream` yields one prompt's output as its tokens arrive.

Several callers may share one `LLM`: streams left open while `generate` runs, or threads. Every
step's outputs go to the queue of the call that owns the request, whoever ran the step, and
one lock keeps two threads from stepping the engine at the same time. A call that stops early
(an exception, Ctrl-C, a stream closed before its end) aborts its own requests, so that they
hold no blocks or batch seats afterwards.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

from tqdm.auto import tqdm

from minillm.engine.args import EngineArgs
from minillm.engine.beam_search import BeamSearchOutput, beam_search
from minillm.engine.llm_engine import LLMEngine, Prompt
from minillm.lora.request import LoRARequest
from minillm.model.lora import LoRASlotsBusy
from minillm.model.tokenizer import Tokenizer
from minillm.outputs import RequestOutput
from minillm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """A model and an engine around it; options are EngineArgs fields (block_size=...)."""

    def __init__(self, model: str | os.PathLike | None = None, **engine_args) -> None:
        args = EngineArgs(**engine_args) if model is None else EngineArgs(model, **engine_args)
        self.engine = LLMEngine(args)
        self._request_counter = itertools.count()
        self._lock = threading.RLock()  # one step, add or abort at a time
        # outputs not yet taken by the call that owns the request, by request id
        self._queues: dict[str, collections.deque[RequestOutput]] = {}
        # what steps the engine instead of this object's calls (a server), if anything
        self._served_by: str | None = None

    def _hand_over(self, owner: str | None) -> None:
        """Give the engine to `owner` (None: take it back). Two consumers stepping one engine
        would each drop the other's outputs, so while an owner holds it, generate, stream and
        beam_search raise, and it is refused while one of them has requests in flight."""
        with self._lock:
            if owner is not None and (self._served_by is not None or self._queues):
                busy = self._served_by or f"{len(self._queues)} requests of this LLM in flight"
                raise RuntimeError(f"this LLM cannot be served now: it is busy ({busy})")
            self._served_by = owner

    def spec_decode_stats(self):
        """Speculative decoding's counters (`SpecDecodingStats`: num_drafts, num_draft_tokens,
        num_accepted_tokens, num_accepted_tokens_per_pos, ...), or None without
        speculative_config."""
        return self.engine.spec_decode_stats()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor or pipeline parallelism); the engine
        cannot run afterwards. Also done at the end of a `with LLM(...) as llm:` block and
        when the interpreter exits."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; returns their outputs in the order of the prompts.

        prompts: text, token ids, vLLM's dicts {"prompt": ...} / {"prompt_token_ids": ...},
        or a sequence of them. sampling_params: one for all prompts, or one per prompt
        (default SamplingParams()). priority: one value per prompt, for an engine with
        scheduling_policy="priority" (lower values first). A request the engine had to abort
        comes back finished with finish_reason "abort" and its `error`. lora_request: the
        LoRA adapter for all prompts, or one (or None) per prompt (enable_lora=True). More
        adapters than the engine keeps loaded (max_cpu_loras) are served in turn: a prompt
        whose adapter finds every loaded one in use waits, and is added (in order) once
        requests finish and an adapter can be swapped out; every adapter is checked first.
        """
        prompts = as_prompt_list(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_requests = [lora_request] * len(prompts)
        else:
            lora_requests = list(lora_request)
            if len(lora_requests) != len(prompts):
                raise ValueError(
                    f"got {len(lora_requests)} lora_requests for {len(prompts)} prompts; "
                    "give one for all or one per prompt"
                )
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, Mapping | str):
            raise ValueError(
                "sampling_params must be a SamplingParams or a sequence of them, got a "
                f"{type(sampling_params).__name__}: build SamplingParams(**options)"
            )
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                    "give one for all or one per prompt"
                )
        # only the final outputs are returned: no step builds the ones in between (vLLM
        # does the same); a copy, so the caller's params keep their own kind
        final_only = {
            id(params): replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            for params in params_list
            if isinstance(params, SamplingParams)
        }
        params_list = [final_only.get(id(params), params) for params in params_list]
        request_ids, held = self._add_requests(
            prompts, params_list, priorities, lora_requests, hold_busy_loras=True
        )
        try:
            return self._run_until_finished(request_ids, use_tqdm, held)
        finally:
            self._abort_unfinished(request_ids)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's `LLM.beam_search`): the best
        params.beam_width sequences of each, best first, as BeamSearchOutput.sequences (their
        tokens include the prompt). Every beam is a request of one token sharing its parent's
        blocks through prefix caching (`minillm.engine.beam_search`)."""
        tokenizer = self.engine.tokenizer
        token_prompts = []
        for prompt in as_prompt_list(prompts):
            _, ids = self.engine.processor.tokenize(prompt)
            token_prompts.append(ids)

        def generate(batch: list[list[int]], sampling_params: SamplingParams):
            return self.generate(batch, sampling_params, use_tqdm=use_tqdm)

        return beam_search(
            generate,
            token_prompts,
            params,
            tokenizer.eos_token_id,
            tokenizer.decode,
            self.engine.max_model_len,
        )

    def _add_requests(
        self,
        prompts: list[Prompt],
        params_list: list[SamplingParams],
        priorities: list[int],
        lora_requests: list[LoRARequest | None] | None = None,
        hold_busy_loras: bool = False,
    ) -> tuple[list[str], list[tuple]]:
        """Queue all prompts, or none: a bad prompt withdraws the ones queued before it.

        Returns every request's id and, with `hold_busy_loras`, the requests held back from
        the first one whose adapter cannot be loaded yet (LoRASlotsBusy) on, as
        `_add_held` takes them; their prompts, options and adapters are checked now, so that
        a bad one fails here. Without it such a request is refused like a bad one."""
        request_ids: list[str] = []
        held: list[tuple] = []
        loras = [None] * len(prompts) if lora_requests is None else lora_requests
        with self._lock:
            if self._served_by is not None:
                raise RuntimeError(
                    f"this LLM is being served by {self._served_by}: stop the server before "
                    "calling generate, stream or beam_search on it, or use a second LLM"
                )
            try:
                for prompt, params, priority, lora in zip(
                    prompts, params_list, priorities, loras, strict=True
                ):
                    request_id = str(next(self._request_counter))
                    request = (request_id, prompt, params, priority, lora)
                    if not held:
                        try:
                            self.engine.add_request(
                                request_id, prompt, params, priority=priority, lora_request=lora
                            )
                        except LoRASlotsBusy:
                            if not hold_busy_loras:
                                raise
                            held.append(request)
                    else:
                        held.append(request)
                    self._queues[request_id] = collections.deque()
                    request_ids.append(request_id)
                for _, prompt, params, _, _ in held:  # what add_request checks before the adapter
                    if not isinstance(params, SamplingParams):
                        raise ValueError(
                            f"params must be a SamplingParams, got {type(params).__name__}"
                        )
                    processor = self.engine.processor
                    processor.check_prompt(processor.tokenize(prompt)[1])
                    processor.check_params(params)
                for lora in {id(r[4]): r[4] for r in held if r[4] is not None}.values():
                    self.engine.lora_manager.check_lora(lora)
            except BaseException:
                self._abort_unfinished(request_ids)
                raise
        return request_ids, held

    def _add_held(self, held: list[tuple]) -> None:
        """Add the held requests, in order, until one's adapter still finds every loaded
        adapter in use (they stay held); a prompt that turns out bad raises."""
        with self._lock:
            while held:
                request_id, prompt, params, priority, lora = held[0]
                try:
                    self.engine.add_request(
                        request_id, prompt, params, priority=priority, lora_request=lora
                    )
                except LoRASlotsBusy:
                    return
                held.pop(0)

    def _run_until_finished(
        self, request_ids: list[str], use_tqdm: bool, held: list[tuple] | None = None
    ) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finished) < len(request_ids):
                if held:
                    self._add_held(held)
                self._step()
                for request_id in request_ids:
                    for output in self._take(request_id):
                        if output.finished:
                            finished[request_id] = output
                            bar.update(1)
        return [finished[request_id] for request_id in request_ids]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the prompt's output after every step that adds to it; the new text of each
        completion is in `outputs[i].delta_text`. Closing the iterator early aborts the request.
        """
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):  # an output after every step, whole
            params = replace(params, output_kind=RequestOutputKind.CUMULATIVE)
        [request_id], _ = self._add_requests([prompt], [params], [0])
        # characters of each completion's text yielded so far: delta_text is cut from the
        # whole text here, so an output that never reached this queue (Ctrl-C in another
        # call, between its step and the queueing) loses no text; streamed text only grows
        num_sent: dict[int, int] = {}
        try:
            while True:
                outputs = self._take(request_id)
                if not outputs:
                    with self._lock:
                        if self._queues[request_id]:
                            continue  # another thread's step queued them after the take
                        processor = self.engine.output_processor
                        if request_id not in processor.states and not any(
                            state.request_id == request_id for state in processor.to_report
                        ):
                            raise RuntimeError(
                                f"request {request_id}'s last output was lost (interrupted "
                                "between a step and its queueing)"
                            )
                    self._step()  # another call may have run the steps that made outputs
                    continue
                for output in outputs:
                    for completion in output.outputs:
                        sent = num_sent.get(completion.index, 0)
                        completion.delta_text = completion.text[sent:]
                        num_sent[completion.index] = len(completion.text)
                    yield output
                    if output.finished:
                        return
        finally:
            self._abort_unfinished([request_id])

    def _step(self) -> None:
        """One engine step; its outputs go to their owners' queues."""
        with self._lock:
            for output in self.engine.step():
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.append(output)

    def _take(self, request_id: str) -> list[RequestOutput]:
        with self._lock:
            queue = self._queues[request_id]
            outputs = list(queue)
            queue.clear()
            return outputs

    def _abort_unfinished(self, request_ids: list[str]) -> None:
        """Abort what is left of these requests and drop their queues."""
        with self._lock:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
                self._queues.pop(request_id, None)


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids or a prompt dict) or a sequence of them -> a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise ValueError(
            "prompts must be a prompt (text, token ids or a prompt dict) or a sequence of "
            f"them, got {prompts!r:.80}"
        )
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt of token ids
    return prompts
