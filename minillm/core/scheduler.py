"""The scheduler: which requests run in the next step, and how many tokens each.

Continuous batching: every step forms a new batch from whatever requests are in flight, so a
request joins the moment there is room and leaves the moment it finishes. Two limits shape a
step: at most `max_num_batched_tokens` tokens (the token budget) and at most `max_num_seqs`
sequences. The policy is vLLM V1's, with no separate prefill and decode phases: a request simply
has `num_tokens - num_computed_tokens` tokens still to compute, one for a decode, many for a
prompt, and the scheduler hands out the budget:

1. Running requests first, oldest first: each gets min(its remaining tokens, budget left). A
   long prompt is thereby split over several steps (chunked prefill). When the KV cache has no
   block for a running request, the newest running request is preempted: its blocks are freed
   and it goes back to the front of the waiting queue, to be recomputed later.
2. Then waiting requests, in the order of the scheduling policy (first come first served by
   default), while budget, seats and blocks remain. A newly admitted request starts after its
   longest cached prefix (prefix caching).

Two options change the policy. `scheduling_policy` orders the waiting queue: "fcfs" (arrival
order), "priority" (lowest `priority` value first, as in vLLM; preemption then takes the lowest
priority first) or "sjf" (shortest job first: the fewest tokens left to compute and generate).
`batching_type="static"` turns continuous batching off: a batch is formed only when the previous
one has completely finished, and nobody joins it on the way (TensorRT-LLM's name for the option).

The plan (`SchedulerOutput`) carries everything the model runner needs: each request's chunk of
tokens and its block table, the block copies that copy-on-write asked for, and which sequences
sample from which row (n > 1: the other completions are forked here, in `schedule`, when the
prompt's last chunk is planned). After the model runs, `update_from_output` appends each sampled
token and checks the stop tokens and the length limits (`check_stop`); text and stop strings
are the engine's output processor's business.

Async scheduling (`EngineArgs.async_scheduling`) plans a step while the previous one's forward
still runs: `schedule_ahead` advances the requests of the step in flight as if it had finished,
with a placeholder (`PLACEHOLDER_TOKEN_ID`) for every token it is still sampling, and plans from
there; `update_from_output` then puts the sampled tokens in the placeholders' place. While a
forward runs, the blocks of the requests it reads are not given back (`forward_done`).

Pipeline parallelism with batches in flight (`EngineArgs.pipeline_batches_in_flight`, vLLM
V1's batch queue) plans a batch while earlier ones are still in later stages:
`schedule_beside` plans from the requests that are in none of the batches in flight, so a
request is in at most one of them and needs no placeholder, and it takes at most an equal
share of the sequences, so that the batches in flight are about the same size.

Prefill/decode disaggregation (`remote_prefill=True`) plans for a decode instance whose
prompts run elsewhere: a prompt's last chunk samples its first token on the prefill instance,
which then sends the request's KV over. After that step the request waits, holding its blocks,
in the state vLLM V1's scheduler calls `WAITING_FOR_REMOTE_KVS`, outside the running batch, so
that the steps go on for everyone else; `update_from_remote_kvs` brings it back, its first
token appended, once the KV has landed. A request aborted while its KV is in transfer keeps
its blocks until the transfer is over (the transfer writes into them), then gives them back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from minillm.core.block_pool import KVCacheBlock
from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.metrics import StepTrace
from minillm.core.request import Request, RequestStatus
from minillm.outputs import SampledToken
from minillm.sampling_params import SamplingParams

SCHEDULING_POLICIES = ("fcfs", "priority", "sjf")
# async scheduling: the token a step in flight is still sampling (no real token has this id)
PLACEHOLDER_TOKEN_ID = -1
BATCHING_TYPES = ("continuous", "static")


def check_scheduler_options(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_chunked_prefill: bool,
    scheduling_policy: str,
    batching_type: str,
) -> None:
    """Raise ValueError for options no scheduler could honour (vLLM's rules where it has them)."""
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(
            f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}"
        )
    if batching_type not in BATCHING_TYPES:
        raise ValueError(f"batching_type must be one of {BATCHING_TYPES}, got {batching_type!r}")
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_model_len", max_model_len),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
            f"({max_num_seqs}): every running sequence needs at least one token per step"
        )
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"without chunked prefill a whole sequence must fit one step: "
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
            f"max_model_len ({max_model_len})"
        )


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens num_computed_tokens .. + num_new_tokens - 1 of its
    all_token_ids, as planned (the request itself moves on after the step)."""

    request: Request
    num_computed_tokens: int  # tokens already in the KV cache: where this step's chunk starts
    num_new_tokens: int
    # the chunk reaches the request's last token, so the step samples the next one; a prefill
    # chunk short of the end of the prompt samples nothing
    samples: bool
    phase: str  # "decode" (the token after the last sampled one) or "prefill"
    block_ids: Sequence[int] = ()  # its block table once the step is planned
    # n > 1: the completions forked from this request in this step; each samples its own token
    # from this request's row of logits
    forks: Sequence[Request] = ()
    # speculative decoding: slots reserved past the request's last token for draft tokens (a
    # decode only), and the drafts the proposer put there; num_new_tokens counts both
    num_lookahead_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    # the chunk's input tokens, copied when the step is planned: the model runner reads these,
    # not the request, which async scheduling moves on while the forward runs. A placeholder
    # here (the last token, a decode planned ahead) is resolved by the forward thread.
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def plan(cls, request: Request, num_new_tokens: int) -> ScheduledRequest:
        num_computed_tokens = request.num_computed_tokens
        num_tokens = len(request.all_token_ids)
        num_lookahead_tokens = max(0, num_computed_tokens + num_new_tokens - num_tokens)
        samples = num_computed_tokens + num_new_tokens >= num_tokens
        # a preempted request recomputing its output tokens is prefilling again
        is_decode = (
            samples
            and num_new_tokens - num_lookahead_tokens == 1
            and num_tokens > len(request.prompt_token_ids)
        )
        return cls(
            request=request,
            num_computed_tokens=num_computed_tokens,
            num_new_tokens=num_new_tokens,
            samples=samples,
            phase="decode" if is_decode else "prefill",
            num_lookahead_tokens=num_lookahead_tokens,
            token_ids=request.all_token_ids[
                num_computed_tokens : num_computed_tokens + num_new_tokens
            ],
        )

    @property
    def sampling_seqs(self) -> list[Request]:
        """The sequences that take a token from this row: the request, then its new forks."""
        return [self.request, *self.forks] if self.samples else []


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step: everything the model runner needs, and nothing it must look up.

    `scheduled` lists the requests to run, in batch order, with their new tokens and block
    tables; `block_copies` are the (src, dst) block copies to make before the forward
    (copy-on-write); `finished_req_ids` are the requests that finished or were aborted since
    the previous plan, whose per-request state the runner may drop.
    """

    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_waiting: int = 0  # requests left in the waiting queue once the step was planned
    num_batched_tokens: int = 0  # sum of num_new_tokens over `scheduled`
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    # async scheduling: the requests were advanced past this step (`Scheduler.schedule_ahead`)
    # before its tokens came back; each token it samples fills a placeholder
    advanced: bool = False

    def seq_ids(self) -> set[str]:
        """Every sequence the step reads the blocks of: the scheduled ones and their forks."""
        return {seq.request_id for s in self.scheduled for seq in (s.request, *s.forks)}

    def trace(self) -> StepTrace:
        """A compact record of the step, for tables and plots."""
        return StepTrace(
            step=self.step,
            scheduled=[(s.request.request_id, s.num_new_tokens, s.phase) for s in self.scheduled],
            preempted=[r.request_id for r in self.preempted],
            num_waiting=self.num_waiting,
        )


class Scheduler:
    """Continuous batching with a token budget, chunked prefill and preemption by recompute."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        scheduling_policy: str = "fcfs",
        batching_type: str = "continuous",
        num_lookahead_tokens: int = 0,
        max_loras: int | None = None,
        remote_prefill: bool = False,
    ) -> None:
        check_scheduler_options(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_chunked_prefill,
            scheduling_policy,
            batching_type,
        )
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.clock = clock
        self.scheduling_policy = scheduling_policy
        self.batching_type = batching_type
        # speculative decoding: KV slots a decode reserves for draft tokens (k), 0 without
        self.num_lookahead_tokens = num_lookahead_tokens
        # multi-LoRA: the running requests use at most this many adapters at once (vLLM's
        # max_loras); a waiting request on another adapter is passed over until one is free
        self.max_loras = max_loras
        # in arrival order, preempted requests in front; the policy orders it (waiting_order)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_steps = 0
        self.num_preemptions = 0
        self.static_batch: set[str] = set()  # batching_type="static": ids of the current batch
        self.finished_req_ids: list[str] = []  # since the last plan
        # async scheduling: the sequences whose blocks the forward in flight reads, and the
        # blocks of those among them that finished since, given back by forward_done
        self.in_flight_ids: set[str] = set()
        self.held_blocks: list[tuple[str, list[KVCacheBlock]]] = []
        self._planning_ahead = False
        # pipeline batches in flight: the sequences the plan being made leaves out (they are in
        # a batch in flight), and the most sequences it takes (None: no limit)
        self._busy_ids: set[str] = set()
        self._batch_seats: int | None = None
        # disaggregation: prompts' last chunks sample on the prefill instance, whose KV and
        # first token arrive later (update_from_remote_kvs); the sequences waiting for theirs,
        # and the finished (aborted) ones whose blocks a transfer still writes into
        self.remote_prefill = remote_prefill
        self.waiting_for_remote_kvs: dict[str, Request] = {}  # by sequence id
        self.finished_awaiting_kvs: dict[str, list[list[KVCacheBlock]]] = {}

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote_kvs)

    @property
    def num_running_seqs(self) -> int:
        """Seats taken: a running request with n > 1 holds seats for its forks to come, and
        a sequence waiting for its KV holds its seat."""
        running = sum(request.num_seqs for request in self.running)
        return running + len(self.waiting_for_remote_kvs)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: running requests first, then waiting ones (chunked prefill)."""
        output = SchedulerOutput(step=self.num_steps)
        self.num_steps += 1
        token_budget = self._schedule_running(output, self.max_num_batched_tokens)
        # a step that had to preempt has no blocks to spare for new requests
        if not output.preempted:
            self._schedule_waiting(output, token_budget)
        self._fork(output)
        output.num_waiting = len(self.waiting)
        output.block_copies = self.kv_cache_manager.take_copy_on_write()
        for scheduled in output.scheduled:
            scheduled.block_ids = self.kv_cache_manager.get_block_ids(scheduled.request.request_id)
        output.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        return output

    def _schedule_running(self, output: SchedulerOutput, token_budget: int) -> int:
        """Give each running request, oldest first, min(its remaining tokens, budget left).

        Returns the budget left over.
        """
        # running[:len(output.scheduled) + skipped] are the requests planned so far, in order,
        # and those skipped because a batch in flight holds them (there is then no preemption)
        skipped = 0
        while len(output.scheduled) + skipped < len(self.running) and token_budget > 0:
            request = self.running[len(output.scheduled) + skipped]
            if request.request_id in self._busy_ids:
                skipped += 1
                continue
            if self._batch_full(output, request):
                break
            num_new_tokens = min(
                request.num_tokens - request.num_computed_tokens + self._lookahead(request),
                token_budget,
            )
            num_planned_tokens = output.num_batched_tokens
            if not self._allocate_or_preempt(request, num_new_tokens, output):
                break  # the request preempted itself: nobody of lower rank is left to make room
            # a victim planned earlier in this step gives its tokens back to the budget
            token_budget += num_planned_tokens - output.num_batched_tokens
            output.scheduled.append(ScheduledRequest.plan(request, num_new_tokens))
            output.num_batched_tokens += num_new_tokens
            token_budget -= num_new_tokens
        return token_budget

    def _lookahead(self, request: Request) -> int:
        """Draft slots for a request in decode: k, fewer near max_model_len or max_tokens (the
        round emits at most drafts + 1 tokens), none for a prompt chunk."""
        if not self.num_lookahead_tokens:
            return 0
        if request.num_tokens - request.num_computed_tokens != 1 or not request.num_output_tokens:
            return 0
        room = self.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, min(self.num_lookahead_tokens, room))

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, output: SchedulerOutput
    ) -> bool:
        """Find blocks for a running request, preempting others until they fit: the newest
        request first, or under the priority policy the lowest priority first.

        Returns False when the request itself had to be preempted.
        """
        while not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
            if self._planning_ahead:
                raise _WouldPreempt  # nothing is freed while the step in flight may read it
            victim = self._preemption_victim()
            self.running.remove(victim)
            # under the priority policy the victim may already be planned for this step
            for i, scheduled in enumerate(output.scheduled):
                if scheduled.request is victim:
                    output.num_batched_tokens -= scheduled.num_new_tokens
                    del output.scheduled[i]
                    break
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preemption_victim(self) -> Request:
        """vLLM's choice: the newest running request, or under the priority policy the one with
        the largest (priority, arrival_time), the newest among equals."""
        if self.scheduling_policy == "priority":
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the request's KV, requeue it at the front.

        Its output tokens are kept; on resume they are recomputed as part of its "prompt"
        (all_token_ids), possibly served from the prefix cache.
        """
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def waiting_order(self) -> list[Request]:
        """The waiting queue in the order the scheduling policy serves it; ties keep queue order
        (arrival order, preempted requests first)."""
        if self.scheduling_policy == "priority":
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        if self.scheduling_policy == "sjf":
            return sorted(self.waiting, key=lambda r: remaining_work_tokens(r, self.max_model_len))
        return list(self.waiting)

    def _admission_order(self) -> list[Request]:
        """The waiting requests that may be admitted, in order. Static batching admits only the
        members of the current batch, and forms the next batch once nothing of it is left."""
        order = self.waiting_order()
        if self.batching_type == "continuous":
            return order
        if not self.running and not any(r.request_id in self.static_batch for r in order):
            self.static_batch.clear()
            num_seats = 0
            for request in order:
                if num_seats + request.num_seqs > self.max_num_seqs:
                    break
                num_seats += request.num_seqs
                self.static_batch.add(request.request_id)
        return [r for r in order if r.request_id in self.static_batch]

    def _schedule_waiting(self, output: SchedulerOutput, token_budget: int) -> None:
        """Admit waiting requests in the policy's order while budget, seats and blocks remain."""
        num_seats_taken = self.num_running_seqs
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        for request in self._admission_order():
            if token_budget <= 0:
                break
            if num_seats_taken + request.num_seqs > self.max_num_seqs:
                break
            if self._batch_full(output, request):
                break
            lora = request.lora_request
            if (
                self.max_loras is not None
                and lora is not None
                and lora.lora_int_id not in loras
                and len(loras) >= self.max_loras
            ):
                continue  # its adapter would be one too many: later requests may go first
            # prefix caching: skip the tokens whose KV is already in cached blocks
            cached_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_cached_tokens
            if not self.enable_chunked_prefill and num_new_tokens > token_budget:
                break  # without chunking a prompt runs whole or waits
            num_new_tokens = min(num_new_tokens, token_budget)
            if not self.kv_cache_manager.allocate_slots(request, num_new_tokens, cached_blocks):
                break  # head-of-line blocking: nobody overtakes the head of the queue
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached_tokens
            request.metrics.record_scheduled(self.clock())
            self.running.append(request)
            if lora is not None:
                loras.add(lora.lora_int_id)
            output.scheduled.append(ScheduledRequest.plan(request, num_new_tokens))
            output.num_batched_tokens += num_new_tokens
            num_seats_taken += request.num_seqs
            token_budget -= num_new_tokens

    def _batch_full(self, output: SchedulerOutput, request: Request) -> bool:
        """Pipeline batches in flight: the plan holds its share of the sequences already."""
        if self._batch_seats is None or not output.scheduled:
            return False
        planned = sum(scheduled.request.num_seqs for scheduled in output.scheduled)
        return planned + request.num_seqs > self._batch_seats

    def _fork(self, output: SchedulerOutput) -> None:
        """n > 1: the prompt is computed once; the other completions fork from it in the step
        that computes its last chunk, and sample their first tokens from the same row.

        Each fork holds a reference to every block of the parent, so the prompt's KV is stored
        once; the first decode write into a shared, partly filled block copies it
        (copy-on-write). Forked after all allocations of the step, so that the forks share the
        blocks this step writes.
        """
        for scheduled in output.scheduled:
            parent = scheduled.request
            if not (scheduled.samples and parent.pending_forks):
                continue
            scheduled.forks, parent.pending_forks = parent.pending_forks, []
            for fork in scheduled.forks:
                self.kv_cache_manager.fork(parent, fork)
                fork.status = RequestStatus.RUNNING
                fork.metrics.record_scheduled(parent.metrics.first_scheduled_time)
                self.requests[fork.request_id] = fork
                self.running.append(fork)
                if parent.request_id in self.static_batch:
                    self.static_batch.add(fork.request_id)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, SampledToken]
    ) -> list[Request]:
        """Advance the scheduled requests past the step that just ran.

        `sampled` holds the token of every sequence that sampled one, by id (forks included).
        Returns the sequences that got a new token, finished ones included.

        An advanced step (`schedule_ahead`) has already counted its tokens as computed and
        holds a placeholder where each sampled token goes; a request that finished meanwhile
        (a stop found one step late, an abort) is skipped: its token is dropped.
        """
        now = self.clock()
        progressed: list[Request] = []
        finished: list[Request] = []
        advanced = output.advanced
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.status.is_finished:
                continue  # finished from outside (abort) while the step ran
            if scheduled.num_lookahead_tokens:
                if self._update_speculative(scheduled, sampled[request.request_id], now):
                    finished.append(request)
                progressed.append(request)
                continue
            if not advanced:
                request.num_computed_tokens += scheduled.num_new_tokens
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            if not scheduled.samples:
                continue
            if self.remote_prefill and scheduled.phase == "prefill":
                self._wait_for_remote_kvs(scheduled)
                continue
            for seq in (request, *scheduled.forks) if scheduled.forks else (request,):
                if seq.status.is_finished:
                    continue
                seq.num_computed_tokens = request.num_computed_tokens
                token = sampled[seq.request_id]
                if advanced:
                    seq.all_token_ids[-1] = token.token_id  # the placeholder's place
                    if token.logprobs is not None:
                        seq.output_logprobs.append(token.logprobs)
                else:
                    seq.append_output_token(token.token_id, token.logprobs)
                seq.metrics.record_token(now)
                progressed.append(seq)
                if check_stop(seq, self.max_model_len):
                    finished.append(seq)
        if finished:
            self._free_finished(finished, now)
        return progressed

    def _wait_for_remote_kvs(self, scheduled: ScheduledRequest) -> None:
        """A prompt's last chunk ran on the prefill instance: its sequences leave the running
        batch, holding their blocks and seats, until their KV and first tokens arrive."""
        for seq in scheduled.sampling_seqs:
            if seq.status.is_finished:
                continue
            seq.num_computed_tokens = scheduled.request.num_computed_tokens
            self.running.remove(seq)
            seq.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote_kvs[seq.request_id] = seq

    def update_from_remote_kvs(self, arrived: list[tuple[str, SampledToken]]) -> list[Request]:
        """Disaggregation: the sequences whose KV has landed on this instance, with the first
        token the prefill instance sampled for each (vLLM V1: `finished_recving`). They rejoin
        the running batch with that token appended, or finish with it; a sequence that was
        aborted meanwhile gives its blocks back now that no transfer writes into them.
        Each arrival leaves the list `arrived` as it is applied, so that those an
        interruption leaves there are still to apply. Returns the sequences that got their
        token."""
        now = self.clock()
        progressed: list[Request] = []
        finished: list[Request] = []
        while arrived:  # in transfer order: an id may have been used again
            seq_id, token = arrived.pop(0)
            held = self.finished_awaiting_kvs.get(seq_id)
            if held:
                self.kv_cache_manager.block_pool.free_blocks(reversed(held.pop(0)))
                if not held:
                    del self.finished_awaiting_kvs[seq_id]
                continue
            seq = self.waiting_for_remote_kvs.pop(seq_id, None)
            if seq is None:
                raise ValueError(f"KV arrived for {seq_id!r}, which is not waiting for any")
            seq.status = RequestStatus.RUNNING
            seq.append_output_token(token.token_id, token.logprobs)
            seq.metrics.record_token(now)
            self.running.append(seq)
            progressed.append(seq)
            if check_stop(seq, self.max_model_len):
                finished.append(seq)
        if finished:
            self._free_finished(finished, now)
        return progressed

    def _update_speculative(self, scheduled: ScheduledRequest, tokens, now: float) -> bool:
        """A speculative decode: append the accepted drafts and the token after them (stopping
        at the first that finishes the request), count as computed the step's first token and
        the accepted drafts, and give back the slots of the rejected ones (both caches share
        the block table). Returns whether the request finished."""
        request = scheduled.request
        tokens = tokens if isinstance(tokens, list) else [tokens]
        num_appended, stopped = 0, False
        for token in tokens:
            request.append_output_token(token.token_id, token.logprobs)
            request.metrics.record_token(now)
            num_appended += 1
            if check_stop(request, self.max_model_len):
                stopped = True
                break
        # the last token appended has no KV yet; each one before it does
        request.num_computed_tokens += num_appended
        self.kv_cache_manager.trim(request, request.num_computed_tokens)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        return stopped

    def finish_requests(
        self,
        request_ids: Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> None:
        """Finish requests from outside the step (abort, a stop string), wherever they are."""
        now = self.clock()
        to_free: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue  # already finished
            in_transfer = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(request)
            for seq in (request, *request.pending_forks):
                seq.status = status
                seq.stop_reason = stop_reason
                seq.metrics.record_finished(now)
            request.pending_forks = []
            if in_transfer:
                # the KV transfer still writes into its blocks: they leave the request's
                # tables now (its id may be used again at once) and the pool when it lands
                del self.waiting_for_remote_kvs[request_id]
                self.finished_awaiting_kvs.setdefault(request_id, []).append(
                    self._take_blocks(request)
                )
                del self.requests[request_id]
                self.finished_req_ids.append(request_id)
                continue
            to_free.append(request)
        if to_free:
            self._free_finished(to_free, now)

    def hold_for_transfer(self, request_id: str) -> None:
        """Disaggregation: a step that finished this request's prompt is being taken back,
        but its KV transfer still writes into the request's blocks: they leave its tables
        (it recomputes into new ones) and go back to the pool when that transfer lands, as an
        aborted request's do (`update_from_remote_kvs`). A request that finished meanwhile
        (aborted while the step was processed) is no longer the scheduler's: `finish_requests`
        has dealt with its blocks already."""
        request = self.requests.get(request_id)
        if request is None:
            return
        self.finished_awaiting_kvs.setdefault(request_id, []).append(self._take_blocks(request))

    def requeue(self, output: SchedulerOutput) -> None:
        """Undo a planned step that did not run (interrupted): every request it scheduled
        gives back its blocks and waits at the front of the queue, in its order, to be
        recomputed; the forks it created wait as sequences of their own."""
        for scheduled in reversed(output.scheduled):
            for seq in reversed([scheduled.request, *scheduled.forks]):
                if seq.is_finished or seq.status == RequestStatus.PREEMPTED:
                    continue
                if seq.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    # disaggregation: its prompt's transfer, sent by this step, was cancelled
                    del self.waiting_for_remote_kvs[seq.request_id]
                else:
                    self.running.remove(seq)
                self._preempt(seq)

    def _free_finished(self, finished: list[Request], now: float) -> None:
        """Finished requests leave the batch (in one pass over it) and give back their blocks."""
        gone = {id(request) for request in finished}
        self.running = [r for r in self.running if id(r) not in gone]
        for request in finished:
            if request.metrics.finished_time is None:
                request.metrics.record_finished(now)
            if request.request_id in self.in_flight_ids:
                self._hold_blocks(request)
            else:
                self.kv_cache_manager.free(request)
            del self.requests[request.request_id]
            self.finished_req_ids.append(request.request_id)

    # pipeline batches in flight ---------------------------------------------------------------

    def schedule_beside(
        self, in_flight: Sequence[SchedulerOutput], num_batches: int
    ) -> SchedulerOutput | None:
        """Pipeline parallelism with `num_batches` batches in flight: plan a batch of the
        requests that are in none of the batches `in_flight` (still in the pipeline's
        stages), or return None (changing nothing that matters) when there is none to plan.

        A request is in at most one batch in flight, so it needs no placeholder: its next
        chunk is planned once its batch's tokens are processed. The batch takes at most its
        share of the sequences no batch in flight holds, ceil(free / batches still to plan),
        so that the batches in flight share the requests about equally. While a batch is in
        flight nothing is preempted (as when planning ahead: the batch reads the blocks a
        preemption frees); a plan that would have to preempt is None, and the engine waits
        for the oldest batch. With nothing in flight this is `schedule` with the share limit.
        """
        self._busy_ids = set().union(*(plan.seq_ids() for plan in in_flight))
        free = sum(r.num_seqs for r in self.running if r.request_id not in self._busy_ids)
        free += sum(r.num_seqs for r in self.waiting)
        # an equal share of the sequences no batch in flight holds, among the batches to come
        self._batch_seats = max(1, -(-free // max(1, num_batches - len(in_flight))))
        self._planning_ahead = bool(in_flight)
        try:
            plan = self.schedule()
        except _WouldPreempt:
            self.num_steps -= 1
            return None
        finally:
            self._busy_ids, self._batch_seats, self._planning_ahead = set(), None, False
        if in_flight and not plan.scheduled:
            # nothing to plan beside the batches in flight: the finished ids wait for the next
            self.num_steps -= 1
            self.finished_req_ids = plan.finished_req_ids + self.finished_req_ids
            return None
        return plan

    # async scheduling -----------------------------------------------------------------------

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """Plan the step after `in_flight` while its forward still runs, or return None (and
        change nothing that matters) where that is not safe; the engine then waits for the
        step and plans after it.

        The requests are first advanced past `in_flight` (`advance`): its tokens count as
        computed, and every sequence it samples for holds a placeholder token, so the next
        plan's positions, KV slots and token budget count the token still being sampled. A
        sequence whose sampled token will be its last by length (max_tokens, max_model_len) is
        known now and left out of the next plan. None when a sequence of `in_flight` reads
        its own history when it samples (`reads_history`), when an unfinished request has a
        penalty (`has_penalties`), when nothing would be left to plan, or when the plan would
        have to preempt: the step in flight may read the blocks a preemption frees. Blocks
        allocated before that was found stay with their requests, which need them for their
        next tokens anyway.
        """
        # a penalty counts the tokens of every row of the batch (the sampler's token counts),
        # so one request with a penalty anywhere rules out planning ahead
        if any(has_penalties(r.sampling_params) for r in self.requests.values()):
            return None
        for scheduled in in_flight.scheduled:
            if any(reads_history(seq) for seq in scheduled.sampling_seqs):
                return None
        running_before = list(self.running)
        self.advance(in_flight)
        if not (self.waiting or self.running):
            self.running = running_before
            self.undo_advance(in_flight)
            return None
        self._planning_ahead = True
        try:
            return self.schedule()
        except _WouldPreempt:
            self.num_steps -= 1
            self.running = running_before
            self.undo_advance(in_flight)
            return None
        finally:
            self._planning_ahead = False

    def advance(self, plan: SchedulerOutput) -> None:
        """Move the requests of a step in flight past it, as update_from_output will: tokens
        computed, a placeholder for each sampled token; those that end by length with it
        leave the running batch now (their blocks stay theirs until the step is processed)."""
        for scheduled in plan.scheduled:
            request = scheduled.request
            if request.is_finished:
                continue
            request.num_computed_tokens += scheduled.num_new_tokens
            for seq in scheduled.sampling_seqs:
                if seq.is_finished:
                    continue
                seq.num_computed_tokens = request.num_computed_tokens
                seq.all_token_ids.append(PLACEHOLDER_TOKEN_ID)
                max_tokens = seq.sampling_params.max_tokens
                if (
                    max_tokens is not None and seq.num_output_tokens >= max_tokens
                ) or seq.num_tokens >= self.max_model_len:
                    self.running.remove(seq)
        plan.advanced = True

    def undo_advance(self, plan: SchedulerOutput) -> None:
        """Take back `advance` for a step whose tokens will not come (interrupted) or that is
        processed the usual way after all: placeholders go, counts return, and a sequence
        left out by length rejoins the running batch (at its end)."""
        for scheduled in plan.scheduled:
            request = scheduled.request
            if request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens -= scheduled.num_new_tokens
            for seq in scheduled.sampling_seqs:
                if seq.is_finished:
                    continue
                if seq.all_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                    seq.all_token_ids.pop()
                if seq.status == RequestStatus.RUNNING:
                    seq.num_computed_tokens = request.num_computed_tokens
                    if seq not in self.running:
                        self.running.append(seq)
        plan.advanced = False

    def forward_done(self, in_flight: SchedulerOutput | Sequence[SchedulerOutput] | None) -> None:
        """A forward finished: `in_flight` (the step planned ahead and already started, the
        pipeline's batches still in flight, or None) is what is read from now on, and the
        blocks held for a finished sequence that none of it reads go back to the pool."""
        if in_flight is None:
            in_flight = []
        elif isinstance(in_flight, SchedulerOutput):
            in_flight = [in_flight]
        self.in_flight_ids = set().union(*(plan.seq_ids() for plan in in_flight))
        still_held = []
        for seq_id, blocks in self.held_blocks:
            if seq_id in self.in_flight_ids:
                still_held.append((seq_id, blocks))
            else:
                self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
        self.held_blocks = still_held

    def _hold_blocks(self, request: Request) -> None:
        """A finished request that the forward in flight still reads: its blocks leave the
        KV-cache manager's tables (its id may be used again at once) but not the pool yet."""
        self.held_blocks.append((request.request_id, self._take_blocks(request)))

    def _take_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The request's blocks, out of the KV-cache manager's tables but not yet free."""
        manager = self.kv_cache_manager
        manager.req_to_block_hashes.pop(request.request_id, None)
        manager._block_ids.pop(request.request_id, None)
        return manager.req_to_blocks.pop(request.request_id, [])


class _WouldPreempt(Exception):
    """schedule_ahead: the plan needs blocks only a preemption would free."""


def reads_history(seq: Request) -> bool:
    """Whether sampling the sequence's next token reads its own tokens so far, which a
    placeholder would hide: a grammar mask (structured outputs, and jump-forward with it)
    follows them, min_tokens counts them until it is reached (penalties: has_penalties)."""
    params = seq.sampling_params
    return params.structured_outputs is not None or seq.num_output_tokens < params.min_tokens


def has_penalties(params: SamplingParams) -> bool:
    """Repetition, frequency or presence penalties: the sampler counts the tokens of every
    row of a batch that has one."""
    return bool(
        params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1
    )


def remaining_work_tokens(request: Request, max_model_len: int) -> int:
    """The size of a request's job as the server knows it: tokens still to compute (its prompt,
    or everything after preemption) plus tokens it may still generate (max_tokens, or up to
    max_model_len without one). Shortest job first sorts by this upper bound; the real output
    length is unknown until the request stops."""
    max_tokens = request.sampling_params.max_tokens
    max_total_tokens = request.num_prompt_tokens + (
        max_tokens if max_tokens is not None else max_model_len
    )
    num_to_generate = min(max_total_tokens, max_model_len) - request.num_tokens
    return request.num_tokens - request.num_computed_tokens + num_to_generate


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether the token just appended finishes the request: stop tokens and length.

    The order is vLLM's. Stop tokens first (EOS unless ignore_eos, then stop_token_ids), only
    once min_tokens tokens are out; then the length limits, max_tokens and max_model_len. Stop
    strings need text, which the engine's output processor makes; it finishes a request whose
    text reaches a stop string in the same step.
    """
    params = request.sampling_params
    token_ids = request.all_token_ids
    token_id = token_ids[-1]
    num_output_tokens = len(token_ids) - len(request.prompt_token_ids)
    # a grammar that allows only stop tokens wins over min_tokens in the sampler: the stop
    # token it forces ends the request, where min_tokens would only make it repeat
    if num_output_tokens >= params.min_tokens or params.structured_outputs is not None:
        if token_id in params.stop_token_ids:
            return _finish(request, RequestStatus.FINISHED_STOPPED, token_id)
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return _finish(request, RequestStatus.FINISHED_STOPPED, None)  # EOS: no stop_reason
    max_tokens = params.max_tokens
    if (max_tokens is not None and num_output_tokens >= max_tokens) or (
        len(token_ids) >= max_model_len
    ):
        return _finish(request, RequestStatus.FINISHED_LENGTH, None)
    return False


def _finish(request: Request, status: RequestStatus, stop_reason: int | str | None) -> bool:
    request.status = status
    request.stop_reason = stop_reason
    return True
