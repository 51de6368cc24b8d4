"""The engine: requests in, one step at a time, outputs out.

`LLMEngine` wires the pieces together (`minillm.engine.build` sizes the KV pool and builds
the runner). `add_request` checks a prompt and its options where they enter
(`minillm.engine.processor`) and queues it; every `step` is one iteration of the loop all
serving engines share:

    plan = scheduler.schedule()                        # who runs, how many tokens, which blocks
    sampled = model_runner.execute_model(plan)         # one forward pass, one sample per sequence
    progressed = scheduler.update_from_output(plan, sampled)  # append; stop tokens and length
    outputs = output_processor ...                     # text, stop strings, streaming deltas

and returns a `RequestOutput` for every prompt that made progress. A step that fails on one
request aborts that request, reports it with its error, and serves the others.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable

import torch

from minillm.core.request import Request, RequestStatus
from minillm.core.scheduler import (
    PLACEHOLDER_TOKEN_ID,
    ScheduledRequest,
    SchedulerOutput,
)
from minillm.distributed.executor import StageError, WorkerError
from minillm.distributed.pipeline import run_bubble
from minillm.distributed.worker import StepRecord
from minillm.engine.args import EngineArgs
from minillm.engine.build import (
    attention_backend,
    build_runners,
    build_scheduler,
    configure_attention,
    quantize_loaded_model,
    size_kv_pool,
)
from minillm.engine.metrics import EngineStats
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.processor import Processor, Prompt
from minillm.lora.request import LoRARequest
from minillm.model.loader import load_model, resolve_device
from minillm.model.lora import LoRAManager
from minillm.model.moe import require_moe, routing_recorder
from minillm.outputs import RequestOutput, SampledToken
from minillm.sampling_params import SamplingParams
from minillm.spec.spec_runner import SpecDecodingStats
from minillm.structured.grammar import StructuredOutputManager

FORWARD_THREAD = "minillm-forward"  # the name of async scheduling's forward thread


def match_torch_threads() -> None:
    """In a thread that runs the model: compute with the process's torch thread count.

    OpenMP keeps its thread count per thread, and a new thread starts at the machine's core
    count whatever `torch.set_num_threads` said in the main thread: a 512 x 512 matrix
    product in a new thread of a process set to one thread started a second OpenMP thread.
    Setting the count in the thread itself keeps it at the process's."""
    torch.set_num_threads(torch.get_num_threads())


_forward_pool: concurrent.futures.ThreadPoolExecutor | None = None
_forward_pool_lock = threading.Lock()


def forward_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one forward thread for async scheduling: shared by every engine, run in
    the order engines hand it their plans (each engine's in its own order), and never ended
    while the process runs.

    With a forward thread per engine, ranks forked after an async engine had ended
    (`MultiprocExecutor`) were seen, rarely, spinning in MKL's buffer allocation
    (`mkl_serv_allocate`, under gdb) in a matrix product until the step timed out; with one
    thread that never ends, not once in 8,600 soak scenarios. The likely mechanism: an ending
    thread releases its per-thread MKL buffers after `join()` has returned, and a fork copies
    memory, not threads, so a lock it held then stays held in the child."""
    global _forward_pool
    with _forward_pool_lock:
        if _forward_pool is None:
            _forward_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=FORWARD_THREAD, initializer=match_torch_threads
            )
        return _forward_pool


def _forget_forward_thread() -> None:
    """In a forked child: the parent's forward thread was not copied; make a new one."""
    global _forward_pool, _forward_pool_lock
    _forward_pool, _forward_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_forward_thread)


class LLMEngine:
    """Continuous-batching inference over one model: add_request, then step until done."""

    def __init__(
        self, engine_args: EngineArgs, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        args = engine_args
        self.engine_args = args  # as given (the server's cache_config_info reads them)
        device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        backend = attention_backend(args, device)
        parallel = args.parallel_config()
        distributed = parallel.world_size > 1 or args.kv_transfer_config is not None
        # several ranks: the worker processes load the weights; this process schedules
        loaded = load_model(args.model, args.dtype, device, backend, weights=not distributed)
        if args.quantization is not None:
            quantize_loaded_model(loaded, args)
        configure_attention(loaded.model, args)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.device = torch.device(device)
        self.clock = clock
        self.max_model_len = args.resolve_max_model_len(self.config)
        spec_config = args.resolve_speculative_config(self.config, self.max_model_len)
        max_num_batched_tokens = args.resolve_max_num_batched_tokens(self.max_model_len)
        pool = size_kv_pool(
            args,
            loaded,
            self.device,
            backend,
            self.max_model_len,
            max_num_batched_tokens,
            spec_config,
            distributed,
        )
        self.kv_cache_manager, self.scheduler = build_scheduler(
            args, pool.num_blocks, self.max_model_len, max_num_batched_tokens, spec_config, clock
        )
        # constrained decoding: the compiled grammars, and each request's place in its own
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer, self.config.vocab_size
        )
        self.enable_jump_forward = args.enable_jump_forward
        # multi-LoRA: adapters beside the base weights, applied per row by the model runner
        self.lora_manager = (
            LoRAManager(loaded.model, args.max_loras, args.max_lora_rank, args.max_cpu_loras)
            if args.enable_lora
            else None
        )
        self.parallel_config = parallel
        # what runs each step: the model runner (or the executor of the worker processes that
        # run it), or speculative decoding around it
        self.executor, self.model_runner, self.spec_runner = build_runners(
            args,
            loaded,
            device,
            backend,
            parallel if distributed else None,
            self.max_model_len,
            pool,
            spec_config,
            self.structured_output_manager,
            self.lora_manager,
        )
        self.runner = self.spec_runner or self.model_runner
        self.processor = Processor(
            self.tokenizer,
            self.config.vocab_size,
            self.max_model_len,
            args.max_num_seqs,
            args.scheduling_policy,
            spec_decode=self.spec_runner is not None,
            multiprocess=self.executor is not None,
            lora_manager=self.lora_manager,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats(window=args.stats_window)
        # async scheduling: forwards run in this thread while the engine plans the next step
        self.async_scheduling = args.async_scheduling
        self._forward_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._last_forward: concurrent.futures.Future | None = None  # the newest handed to it
        self._in_flight: tuple[SchedulerOutput, concurrent.futures.Future] | None = None
        # per plan not yet processed (by id): its sampling sequences' token counts when it was
        # made, and their random streams before it ran, to rewind them if it is put back
        self._plan_lengths: dict[int, dict[str, int]] = {}
        self._plan_generators: dict[int, dict | None] = {}
        self._previous_token_ids: dict[str, int] = {}  # the forward thread's last tokens
        # pipeline parallelism: the batches handed to the stages whose tokens have not been
        # processed, oldest first, and how many may be (None: each step drains the pipeline)
        self.pipeline_batches_in_flight = args.pipeline_batches_in_flight
        self._batches: collections.deque[SchedulerOutput] = collections.deque()
        # disaggregation: the transfers that landed, taken from the executor and not yet
        # handed to the scheduler (kept across a step that raises while they are processed)
        self._arrived: list[tuple[str, SampledToken | None]] = []
        if self.async_scheduling:
            self._forward_thread = forward_thread()
        if self.device.type == "cuda":
            print(
                f"minillm: KV cache of {pool.num_blocks:,} blocks x {args.block_size} tokens "
                f"({pool.num_blocks * pool.block_bytes / 2**30:.2f} GiB) on {device}"
            )

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a prompt (text, token ids, or vLLM's prompt dicts). Raises ValueError, and
        queues nothing, when the prompt or the options cannot be served; the requests in
        flight carry on.

        priority: with scheduling_policy="priority", lower values are served first (vLLM's
        convention); any other policy accepts only the default 0.

        lora_request: the LoRA adapter to run it with (an engine with enable_lora=True); the
        adapter is loaded here the first time it is named.
        """
        prompt_text, prompt_token_ids, params = self.processor.process(
            request_id, prompt, params, priority
        )
        in_use = {
            request.lora_request.lora_int_id
            for request in self.scheduler.requests.values()
            if request.lora_request is not None
        }
        self.processor.check_lora_request(lora_request, in_use)
        seq_ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
        if self.output_processor.is_in_use(request_id, seq_ids):
            raise ValueError(f"request id {request_id!r} is already in use")

        arrival_time = self.clock() if arrival_time is None else arrival_time
        seqs = [
            Request(
                seq_id,
                prompt_token_ids,
                params,
                arrival_time,
                eos_token_ids=self.eos_token_ids,
                index=index,
                priority=priority,
                lora_request=lora_request,
            )
            for index, seq_id in enumerate(seq_ids)
        ]
        # n > 1: one sequence is scheduled; the scheduler forks the others from it when the
        # prompt's last chunk is planned
        seqs[0].pending_forks = seqs[1:]
        if self.enable_jump_forward and params.n == 1:
            # text the grammar forces from the start joins the prefill (forks, n > 1, begin
            # from the prompt alone, so they do not)
            self._jump_forward(seqs)
        self.output_processor.add_request(request_id, prompt_text, seqs)
        self.scheduler.add_request(seqs[0])

    def abort_request(self, request_id: str, error: str | None = None) -> None:
        """Stop a prompt's sequences and free their blocks; the next step reports it finished
        with finish_reason "abort" (and `error`, when given). Its id may be used again at once.
        Unknown or finished ids are ignored."""
        state = self.output_processor.states.get(request_id)
        if state is None:
            return
        seq_ids = [seq.request_id for seq in state.seqs]
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
        for seq in state.seqs:  # forks not created yet are finished with their parent
            if not seq.is_finished:
                seq.status = RequestStatus.FINISHED_ABORTED
        state.error = error
        for seq in state.seqs:
            self.structured_output_manager.free(seq.request_id)
        self.output_processor.report(state)

    def has_unfinished_requests(self) -> bool:
        # disaggregation: an aborted request's blocks go back when its KV transfer lands
        return bool(
            self.output_processor.states
            or self.output_processor.to_report
            or self.scheduler.finished_awaiting_kvs
        )

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, update the requests, report progress."""
        if self.async_scheduling:
            return self._step_async()
        if self.pipeline_batches_in_flight:
            return self._step_pipelined()
        plan = self.scheduler.schedule()
        self._note_plan(plan)
        try:
            sampled, failed = self._execute(plan)
        except WorkerError:
            raise
        except BaseException:
            # interrupted (Ctrl-C): nothing of the step happened; its requests recompute later
            self._cancel_transfers()
            self._rewind_generators([plan])
            self.scheduler.requeue(plan)
            raise
        try:
            self._take_arrived()
            return self._process(plan, sampled, failed)
        except BaseException:
            # interrupted or a bug while processing: the step may be half applied; its
            # unfinished requests recompute from the tokens they have, the finished ones are
            # reported
            self._cancel_transfers()
            self._rewind_generators([plan])
            self.scheduler.requeue(plan)
            self._drop_stale_arrivals()
            self._report_stranded()
            raise

    def _report_stranded(self) -> None:
        """After a step raised: a request the scheduler finished without the output processor
        seeing it is reported as it ended, and one the scheduler no longer knows is aborted,
        so that no caller waits for a request that will never progress."""
        for state in list(self.output_processor.states.values()):
            if all(seq.is_finished for seq in state.seqs):
                for seq in state.seqs:
                    self.structured_output_manager.free(seq.request_id)
                self.output_processor.report(state)
            elif not any(seq.request_id in self.scheduler.requests for seq in state.seqs):
                self.abort_request(state.request_id, error="lost by a step that raised")

    def _step_async(self) -> list[RequestOutput]:
        """One iteration with async_scheduling: overlap scheduling, as in SGLang's overlap
        scheduler and vLLM V1's async scheduling (names as in vLLM V1's source, main branch of
        late 2026: `AsyncScheduler` counts `num_output_placeholders`, the GPU model runner
        reads `prev_sampled_token_ids`).

        Step n's forward runs in the forward thread. While it runs, this thread plans step
        n + 1 (`Scheduler.schedule_ahead`) as if step n were done: every sequence step n
        samples for gets a placeholder token (vLLM: `num_output_placeholders`), counted in
        n + 1's positions, KV slots and token budget; a sequence whose token in step n is its
        last by length (max_tokens, max_model_len) is not planned again. Plan n + 1 goes to the
        forward thread, which runs plans strictly in order: when it starts n + 1, forward n has
        finished, so it puts each sequence's token from step n in its placeholder's place (the
        decode row's input token; vLLM fills the input ids from `prev_sampled_token_ids`)
        before it builds the batch. This thread never waits for forward n to plan n + 1. Then
        it takes step n's tokens and processes them (requests updated, stop tokens and
        strings, text, outputs) while forward n + 1 runs. Nothing a forward reads changes
        under it: the plan carries its input tokens and block tables, and the blocks of a
        request that finishes while a forward that reads them runs go back to the pool only
        when that forward is done (`Scheduler.forward_done`).

        Stops are found one step late: EOS, stop tokens and stop strings of step n come out
        after plan n + 1 was made, so a request that stopped in step n may be in step n + 1's
        batch; its token there is computed and dropped, and the outputs are exactly those of
        the engine without the option.

        The engine waits for step n, processes it and plans step n + 1 after it (no overlap
        for that step, as without the option) where planning ahead is not safe: a sequence of
        step n that reads its own tokens when it samples (a structured output's grammar mask,
        and jump-forward with it, follows them; min_tokens counts them until it is reached),
        an unfinished request with a repetition, frequency or presence penalty (the sampler
        counts the tokens of every row of a batch that has one), a plan that would have to
        preempt (the step in flight reads the blocks a preemption frees), or nothing left to
        plan. Logprobs and n > 1 (beam search is built on both) read nothing of the history
        and overlap. Speculative decoding and worker processes are refused (`EngineArgs`). A
        forward that raises is re-run one request at a time in the forward thread, before the
        next plan's placeholders are resolved (`_run_one_by_one`); Ctrl-C waits for the
        forward thread and requeues both steps.
        """
        if self._in_flight is None:
            plan = self.scheduler.schedule()
            self._in_flight = (plan, self._start_forward(plan))
        plan, future = self._in_flight
        self._in_flight = None
        outputs = self._finish_step_async(plan, future)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            # every request of step n + 1 stopped in step n: take it in now, so that its
            # blocks go back and the engine is idle once it reports nothing unfinished
            plan, future = self._in_flight
            self._in_flight = None
            outputs += self._finish_step_async(plan, future, plan_ahead=False)
        return outputs

    def _finish_step_async(
        self, plan: SchedulerOutput, future: concurrent.futures.Future, plan_ahead: bool = True
    ) -> list[RequestOutput]:
        """Plan the next step while `plan`'s forward runs (unless told not to), then take in
        and process `plan`'s tokens. Whatever raises on the way (Ctrl-C, a bug in planning or
        processing) leaves no step half done: both steps are taken back once the forward
        thread is idle and their requests recompute later, other callers' requests included,
        which therefore never keep a placeholder or blocks that nobody gives back."""
        try:
            if plan_ahead and self.scheduler.has_unfinished_requests():
                ahead = self.scheduler.schedule_ahead(plan)  # overlaps forward n
                if ahead is not None:
                    self._in_flight = (ahead, self._start_forward(ahead))
            sampled, failed = future.result()
            self.scheduler.forward_done(None if self._in_flight is None else self._in_flight[0])
            return self._process(plan, sampled, failed)  # overlaps forward n + 1
        except BaseException:
            self._requeue_in_flight(plan, future)
            raise

    def _cancel_transfers(self) -> None:
        """Disaggregation, a step taken back: the prefill rank still sends the KV of the
        prompts that step finished, so their blocks stay held until it has landed, and no
        other request can be given them meanwhile."""
        if self.executor is None or self.executor.spec.kv_transfer is None:
            return
        for request_id in self.executor.cancel_step():
            self.scheduler.hold_for_transfer(request_id)

    def _step_pipelined(self) -> list[RequestOutput]:
        """One iteration with pipeline batches in flight (vLLM V1's batch queue, with
        `pipeline_parallel_size` batches): fill the pipeline, then take in the oldest batch.

        While fewer than `pipeline_batches_in_flight` batches are in the stages, plan one
        more from the requests in none of them (`Scheduler.schedule_beside`) and hand it to
        the ranks without waiting (`MultiprocExecutor.submit_model`). Then wait for the
        oldest batch's tokens and process them, as a step without the option does; the next
        step plans that batch's requests again. The first stage thus starts batch k + 1 as
        soon as it has sent batch k's hidden states on, and the pipeline fills once rather
        than every step. As with async scheduling, the blocks of a request that finishes
        while a batch that reads them is in flight go back to the pool only when it comes
        back (`Scheduler.forward_done`).

        A batch that a stage raises on (`StageError`) is run again one request at a time,
        as a step that raises is without the option (`_run_one_by_one`); a rank that dies or
        stalls stops them all (`WorkerError`). An interruption
        (Ctrl-C) or an error while planning or processing takes back every batch not yet
        processed: once the ranks have answered them all, their requests recompute later.
        """
        plan = None
        try:
            self._fill_pipeline()
            plan = self._batches.popleft()
            try:
                sampled, failed = self.executor.collect_model(), []
            except StageError:
                # a stage raised on this batch: run its requests again, each alone (after the
                # batches in flight), to find the ones it fails on; the others carry on
                sampled, failed = self._run_one_by_one(plan, None)
            self.scheduler.forward_done(self._batches)
            outputs = self._process(plan, sampled, failed)
            if self._batches and not self.scheduler.has_unfinished_requests():
                # every request of the batches left finished or was aborted: take them in now,
                # so that their blocks go back and the engine is idle
                outputs += self._drain_batches()
            return outputs
        except WorkerError:
            raise
        except BaseException:
            self._requeue_batches(plan)
            raise

    def _fill_pipeline(self) -> None:
        """Hand the ranks new batches until pipeline_batches_in_flight are in flight, or none
        can be planned beside those in flight (with none in flight: always one, maybe empty)."""
        while len(self._batches) < self.pipeline_batches_in_flight:
            if self._batches and not self.scheduler.has_unfinished_requests():
                return
            plan = self.scheduler.schedule_beside(self._batches, self.pipeline_batches_in_flight)
            if plan is None:
                return
            self._note_plan(plan)
            self._batches.append(plan)
            self.executor.submit_model(plan)

    def _drain_batches(self) -> list[RequestOutput]:
        """Take in every batch in flight, oldest first (their requests have all finished)."""
        outputs = []
        while self._batches:
            plan = self._batches.popleft()
            try:
                sampled = self.executor.collect_model()
            except StageError:
                sampled = {}  # nobody is left to take its tokens
            self.scheduler.forward_done(self._batches)
            outputs += self._process(plan, sampled, [])
        return outputs

    def _requeue_batches(self, processing: SchedulerOutput | None) -> None:
        """Interrupted with batches in flight: wait for the ranks to answer every batch handed
        to them, then put back the batches not processed and the one being processed (it may
        be half applied), latest first, so their requests recompute in their order."""
        plans = list(self._batches)
        self._batches.clear()
        for _ in range(self.executor.batches_in_flight()):
            try:
                self.executor.collect_model()
            except StageError:
                pass  # its requests recompute anyway
        if processing is not None:
            plans.insert(0, processing)
        self._rewind_generators(plans)
        for plan in reversed(plans):
            self.scheduler.requeue(plan)
        self.scheduler.forward_done(None)
        self._report_stranded()

    def _take_arrived(self) -> None:
        """Disaggregation: take (sequence id, first token) of the requests whose KV has landed
        on the decode rank since the last step into `_arrived`, where they stay until the
        scheduler has them (a step that raises meanwhile loses none)."""
        if self.executor is not None and self.executor.spec.kv_transfer is not None:
            self._arrived += self.executor.take_arrived()

    def _drop_stale_arrivals(self) -> None:
        """Disaggregation, a step taken back after its arrivals were taken: keep those a
        request still waits for (its KV, or the release of the blocks held for a transfer),
        oldest first; drop the arrival of a prompt the step sent whose KV landed at once,
        since the request now recomputes it (its blocks were given back, the write done)."""
        scheduler, kept = self.scheduler, []
        owed = collections.Counter(
            {seq_id: len(held) for seq_id, held in scheduler.finished_awaiting_kvs.items()}
        )
        owed.update(scheduler.waiting_for_remote_kvs.keys())
        for seq_id, token in self._arrived:
            if owed[seq_id] > 0:
                owed[seq_id] -= 1
                kept.append((seq_id, token))
        self._arrived = kept

    def _process(self, plan: SchedulerOutput, sampled: dict, failed: list) -> list[RequestOutput]:
        """Step `plan`'s tokens: update the requests, text and stop strings, stats, outputs;
        disaggregated, the requests whose KV has landed as well (`_take_arrived`)."""
        self._abort_failed(failed)
        progressed = self.scheduler.update_from_output(plan, sampled)
        if self._arrived:
            progressed += self.scheduler.update_from_remote_kvs(self._arrived)
        if self.enable_jump_forward:
            self._jump_forward(progressed)
        stopped, failed_text = self.output_processor.detokenize(progressed)
        self._finish_stopped(stopped, failed_text)
        self.stats.record_step(plan, self.scheduler, self.kv_cache_manager)
        for seq in progressed:
            if seq.is_finished:
                self.structured_output_manager.free(seq.request_id)
        for scheduled in plan.scheduled:
            # aborted while this plan's forward ran: the sampler may have made its matcher
            # again after the abort freed it
            for seq in (scheduled.request, *scheduled.forks):
                if seq.is_finished and seq.sampling_params.structured_outputs is not None:
                    self.structured_output_manager.free(seq.request_id)
        outputs = self.output_processor.make_outputs(progressed)
        # processed whole: nothing of it will be put back (an interruption before here leaves
        # these for _rewind_generators)
        self._plan_lengths.pop(id(plan), None)
        self._plan_generators.pop(id(plan), None)
        return outputs

    def _start_forward(self, plan: SchedulerOutput) -> concurrent.futures.Future:
        self._note_plan(plan)
        self._last_forward = self._forward_thread.submit(self._forward_in_order, plan)
        return self._last_forward

    def _note_plan(self, plan: SchedulerOutput) -> None:
        """When a plan is made: each sampling sequence's token count, to tell after an
        interruption whether the plan's token reached it (`_rewind_generators`)."""
        self._plan_lengths[id(plan)] = {
            seq.request_id: len(seq.all_token_ids)
            for scheduled in plan.scheduled
            for seq in scheduled.sampling_seqs
        }

    def _rewind_generators(self, plans: list[SchedulerOutput]) -> None:
        """Plans put back after an interruption (Ctrl-C), in the order they ran: a seeded
        sequence's random stream goes back to where it was before the first of them whose
        token it did not keep, so that it does not draw again for the same token: its next
        token is the one a run without the interruption samples. A plan's token was kept
        when the sequence grew past its count at planning and ends in a real token (async
        scheduling: not the placeholder of a step planned ahead)."""
        restore: dict[str, object] = {}
        workers = self.executor is not None  # they hold the streams, by step (Worker)
        for plan in reversed(plans):  # the earliest plan last: its state wins
            lengths = self._plan_lengths.pop(id(plan), {})
            states = self._plan_generators.pop(id(plan), None)
            if states is None and not workers:  # it never ran (cancelled)
                continue
            for scheduled in plan.scheduled:
                for seq in scheduled.sampling_seqs:
                    kept = (
                        len(seq.all_token_ids) > lengths.get(seq.request_id, len(seq.all_token_ids))
                        and seq.all_token_ids[-1] != PLACEHOLDER_TOKEN_ID
                    )
                    if kept or seq.is_finished:
                        continue
                    if workers:
                        restore[seq.request_id] = plan.step
                    elif seq.request_id in states:
                        restore[seq.request_id] = states[seq.request_id]
        if not restore:
            return
        if workers:
            if self.executor.spec.kv_transfer is None:  # disaggregated: not rewound
                self.executor.call("rewind_streams", restore)
        else:
            self.model_runner.restore_generators(restore)

    def _forward_in_order(self, plan: SchedulerOutput) -> tuple[dict, list]:
        """Runs in the forward thread, one plan after the other: resolve the plan's
        placeholders from the previous forward's tokens, then run it."""
        previous = self._previous_token_ids
        for scheduled in plan.scheduled:
            token_ids = scheduled.token_ids
            if token_ids and token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                # absent only for a request the previous forward failed on: it is aborted
                # before this step is processed, and this row's token is dropped
                token_ids[-1] = previous.get(scheduled.request.request_id, 0)
        sampled, failed = self._execute(plan)
        self._previous_token_ids = {seq_id: token.token_id for seq_id, token in sampled.items()}
        return sampled, failed

    def _requeue_in_flight(self, plan: SchedulerOutput, future: concurrent.futures.Future) -> None:
        """Interrupted (Ctrl-C) while step `plan` ran: once the forward thread is idle, neither
        it nor the step planned ahead happened; their requests recompute later."""
        futures = [future]
        if self._in_flight is not None:
            ahead, ahead_future = self._in_flight
            self._in_flight = None
            ahead_future.cancel()
            futures.append(ahead_future)
            concurrent.futures.wait(futures)
            self._rewind_generators([plan, ahead])
            self.scheduler.requeue(ahead)
        else:
            concurrent.futures.wait(futures)
            self._rewind_generators([plan])
        if plan.advanced:
            self.scheduler.undo_advance(plan)
        self.scheduler.requeue(plan)
        self.scheduler.forward_done(None)
        self._report_stranded()

    def _execute(self, plan: SchedulerOutput) -> tuple[dict, list]:
        """The plan's sampled tokens, and the requests it failed on (none when the batch ran)."""
        generators = self._generator_states(plan)
        try:
            return self.runner.execute_model(plan), []
        except WorkerError:
            raise  # the worker processes are gone: no request can run any more
        except Exception:  # noqa: BLE001 - isolated per request, then reported
            return self._run_one_by_one(plan, generators)

    def _generator_states(self, plan: SchedulerOutput) -> dict | None:
        """The random streams of the plan's sequences before it runs (one process only: the
        worker processes' driver rank keeps its own by step and puts them back itself when a
        step runs again, `Worker.rewind_streams` when the engine takes steps back)."""
        if self.executor is not None:
            return None
        seq_ids = [seq.request_id for s in plan.scheduled for seq in s.sampling_seqs]
        states = self.model_runner.generator_states(seq_ids)
        self._plan_generators[id(plan)] = states  # to rewind if the plan is put back
        return states

    def _abort_failed(self, failed: list[tuple[ScheduledRequest, str]]) -> None:
        for scheduled, message in failed:
            state = self.output_processor.state_of_seq.get(scheduled.request.request_id)
            if state is not None:
                self.abort_request(state.request_id, error=message)

    def _finish_stopped(self, stopped: list, failed: list) -> None:
        """Finish what the output processor found: stop strings reached, text that failed."""
        for seq, message in failed:
            state = self.output_processor.state_of_seq.get(seq.request_id)
            if state is not None:
                self.abort_request(state.request_id, error=message)
        for seq, stop_str in stopped:
            if seq.is_finished:  # stopped on length in the same step, or aborted
                if seq.status != RequestStatus.FINISHED_ABORTED:
                    seq.status, seq.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            else:
                self.scheduler.finish_requests(
                    [seq.request_id], RequestStatus.FINISHED_STOPPED, stop_str
                )

    def _jump_forward(self, progressed: list) -> None:
        """Jump-forward decoding: where a constrained request's grammar forces the next text,
        append its tokens now. The next step computes them in one forward, as a chunk, and
        samples after the last of them: no forward per forced token.

        Not for requests that asked for logprobs (a forced token has no sampled logprob), and
        never up to max_tokens or max_model_len: the model still samples the token after.
        """
        manager = self.structured_output_manager
        for seq in progressed:
            params = seq.sampling_params
            if seq.is_finished or params.structured_outputs is None or params.logprobs is not None:
                continue
            room = self.max_model_len - seq.num_tokens - 1
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - seq.num_output_tokens - 1)
            tokens = manager.jump_forward_tokens(
                seq.request_id,
                params.structured_outputs.pattern,
                seq.output_token_ids,
                [*seq.eos_token_ids, *params.stop_token_ids],
                room,
            )
            for token_id in tokens:
                seq.append_output_token(token_id, None)

    def shutdown(self) -> None:
        """Stop the worker processes of a multi-process engine, or wait until async
        scheduling's forward thread (shared, `forward_thread`) has run this engine's last
        plan (nothing to do otherwise)."""
        if self.executor is not None:
            self.executor.shutdown()
        if self._last_forward is not None:  # the shared forward thread is done with ours
            concurrent.futures.wait([self._last_forward])

    def spec_decode_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's counters since the engine started (None without it)."""
        return None if self.spec_runner is None else self.spec_runner.stats

    def collective_stats(self) -> list[StepRecord]:
        """Per step, what the driver rank did: tokens, sampled rows, and the calls and bytes
        of every collective (tensor parallelism: 2 * num_hidden_layers all-reduces of
        [num_tokens, hidden_size] plus one for the vocabulary-parallel embedding, and one
        all-gather of the sampled rows' logits). Empty on one process."""
        if self.executor is None:
            return []
        return self.executor.call("step_records")[self.parallel_config.driver_rank]

    def pipeline_stats(self) -> list[list[StepRecord]]:
        """Per pipeline stage, its step records with their timing (busy and wall time)."""
        if self.parallel_config.pipeline_parallel_size == 1:
            raise ValueError("pipeline_stats needs an engine with pipeline_parallel_size > 1")
        return self.executor.call("step_records")

    def pipeline_bubble(self) -> float:
        """The stages' idle share since the last clear_parallel_stats, measured over the whole
        run of steps (`pipeline.run_bubble`): the pipeline's fill and drain, and every gap in
        which a stage waited for work."""
        stages = self.pipeline_stats()
        timings = [[record.timing for record in records if record.timing] for records in stages]
        if not all(timings):
            raise ValueError("no pipeline step ran since the statistics were cleared")
        return run_bubble(timings)

    def clear_parallel_stats(self) -> None:
        if self.executor is not None:
            self.executor.call("clear_step_records")
        elif self.config.is_moe:
            routing_recorder(self.model_runner.model).reset_load()

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert of every MoE layer, {layer: [count per expert]}
        (k per token and layer), since the last clear_parallel_stats; ValueError for a model
        without experts. With worker processes, the sum of their step records
        (collective_stats()[i].expert_load has each step's)."""
        if self.executor is None:
            return routing_recorder(self.model_runner.model).load_lists()
        self._check_routing_recorded()
        total: dict[int, list[int]] = {}
        for records in self.executor.call("step_records"):  # ranks: the same layers or others
            rank_total: dict[int, list[int]] = {}
            for record in records:
                for layer, counts in (record.expert_load or {}).items():
                    old = rank_total.get(layer, [0] * len(counts))
                    rank_total[layer] = [a + b for a, b in zip(old, counts, strict=True)]
            for layer, counts in rank_total.items():
                total.setdefault(layer, counts)
        return dict(sorted(total.items()))

    def start_routing_record(self) -> None:
        """Record the experts every token is routed to, per forward pass and MoE layer."""
        self._routing("start_record")

    def stop_routing_record(self) -> list[dict[int, torch.Tensor]]:
        """Stop recording; the routes: one {layer: expert ids [num_tokens, k]} per pass."""
        traces = self._routing("stop_record")
        # pipeline stages each hold their own layers of the same passes: merge them
        return [dict(collections.ChainMap(*passes)) for passes in zip(*traces, strict=True)]

    def start_routing_replay(self, trace: list[dict[int, torch.Tensor]]) -> None:
        """Route every token of the following passes to the experts `trace` recorded (the
        router's probabilities still weight them): a run of the same requests with the same
        options repeats the recorded routes exactly, whatever the routers compute now."""
        self._routing("start_replay", trace)

    def stop_routing_replay(self) -> int:
        """Route with the routers again; the number of passes replayed."""
        return self._routing("stop_replay")[0]

    def _routing(self, method: str, *args) -> list:
        """A RoutingRecorder method on the model of every rank; their results."""
        if self.executor is None:
            return [getattr(routing_recorder(self.model_runner.model), method)(*args)]
        self._check_routing_recorded()
        return self.executor.call("routing_call", method, *args)

    def _check_routing_recorded(self) -> None:
        require_moe(self.config)
        if self.executor.spec.kv_transfer is not None:
            raise ValueError(
                "expert load and routing replay are not recorded with kv_transfer_config; "
                "run the model colocated or with tensor_parallel_size"
            )

    def _run_one_by_one(
        self, plan: SchedulerOutput, generators: dict | None
    ) -> tuple[dict, list[tuple[ScheduledRequest, str]]]:
        """The batch failed: run each scheduled request alone to find the ones it fails on.

        Returns the tokens of the others, and the failed requests with their error, which the
        engine aborts and reports: one bad request costs the others nothing. When every
        request runs alone, the fault was the batch's (a transient error, memory the batch
        needed but a request alone does not) and the step goes on with their tokens. Keys and
        values written by the failed attempt are written again with the same values, and each
        seeded sequence's random stream is put back first (`generators`), so the tokens are
        those of a clean run. With async scheduling this runs in the forward thread, so that
        the next plan's placeholders are resolved from these tokens.
        """
        sampled: dict = {}
        failed: list[tuple[ScheduledRequest, str]] = []
        # the copy-on-write copies go with the first run, before any run writes: the failed
        # attempt may have raised before making them, and making them again is harmless
        copies = plan.block_copies
        for scheduled in plan.scheduled:
            if all(seq.is_finished for seq in (scheduled.request, *scheduled.forks)):
                # finished meanwhile (aborted while its batch was in flight): nobody takes its
                # tokens, and the worker ranks have dropped its random streams (the copies
                # go with the next run)
                continue
            if generators is not None:
                self.model_runner.restore_generators(
                    {seq.request_id: generators[seq.request_id] for seq in scheduled.sampling_seqs}
                )
            alone = SchedulerOutput(step=plan.step, scheduled=[scheduled], block_copies=copies)
            copies = []
            try:
                sampled.update(self.runner.execute_model(alone))
            except WorkerError:
                raise
            except Exception as error:  # noqa: BLE001 - reported with the request
                failed.append((scheduled, f"{type(error).__name__}: {error}"))
        return sampled, failed
