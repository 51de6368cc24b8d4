"""Admission control: when may a waiting request start to hold KV cache? Three engines' rules,
simulated on one pool.

A request that is admitted writes its prompt's keys and values into the pool and then grows by
one token per step until it stops. When it will stop is unknown: `max_tokens` is only an upper
bound. Engines differ in how much of that future they reserve before they admit a request:

    vLLM (V1)                 the tokens it computes now (its prompt) fit in the free slots;
                              later growth is not reserved. When a running request cannot grow,
                              the newest running request is preempted (recomputed later) and
                              goes back to the front of the queue.
    SGLang                    prompt + min(max_tokens, clip) of the new request, plus, for every
                              running request, its remaining max_tokens times new_token_ratio (a
                              forecast, 0.7 at start, decaying towards 0.098), stay below the
                              free slots. When decode runs out of room, requests are retracted,
                              fewest output tokens first, to the back of the queue, and the
                              ratio is raised to what the survivors have actually used.
    TensorRT-LLM              prompt + max_tokens of the new request, plus what every running
    (GUARANTEED_NO_EVICT)     request may still need up to its max_tokens, fit in the pool: a
                              started request is never evicted.

All three take the queue in order and stop at the first request that does not fit (head-of-line
blocking). `admit_vllm`, `admit_sglang` and `admit_trtllm` make one decision on a snapshot of the
pool; `simulate_pool` runs a whole workload step by step under one of them. The pool is counted
in token slots (a page size of 1, as SGLang's default); blocks of 16 or 64 tokens round every
figure up but change none of the rules. Prefill runs whole, within the step that admits it.

Sources: vLLM v1/core/sched/scheduler.py; SGLang managers/schedule_policy.py (PrefillAdder) and
schedule_batch.py (retract_decode); TensorRT-LLM batch_manager/capacityScheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("vllm", "sglang", "trtllm")

# SGLang's defaults (environment variables SGLANG_INIT_NEW_TOKEN_RATIO,
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS,
# SGLANG_RETRACT_DECODE_STEPS, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION)
SGLANG_INIT_NEW_TOKEN_RATIO = 0.7
SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS = 600
SGLANG_RETRACT_DECODE_STEPS = 20
SGLANG_CLIP_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """A request by its sizes. `num_output_tokens` is how many tokens it will really generate
    before it stops (at most max_tokens); no admission rule may look at it."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(
                f"request {self.request_id!r} needs at least one prompt token and max_tokens >= 1"
            )
        if not 1 <= self.num_output_tokens <= self.max_tokens:
            raise ValueError(
                f"request {self.request_id!r}: num_output_tokens must be in [1, max_tokens="
                f"{self.max_tokens}], got {self.num_output_tokens}"
            )


@dataclass(slots=True)
class PoolEntry:
    """A request in the engine: the tokens it has generated so far (kept when it is preempted),
    and whether its KV is in the pool (running) or not (waiting)."""

    request: PoolRequest
    num_generated: int = 0

    @property
    def num_tokens_to_compute(self) -> int:
        """What a prefill must compute on admission: the prompt, and after a preemption the
        tokens generated before it (recomputation)."""
        return self.request.num_prompt_tokens + self.num_generated

    @property
    def num_slots_held(self) -> int:
        """KV slots of a running request: one per prompt token and per generated token (the
        last one's slot is taken as it is sampled, before the step that computes it)."""
        return self.request.num_prompt_tokens + self.num_generated

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens it may still generate as far as the engine knows: max_tokens minus outputs."""
        return self.request.max_tokens - self.num_generated


def num_free_slots(running: Sequence[PoolEntry], capacity_slots: int) -> int:
    return capacity_slots - sum(e.num_slots_held for e in running)


def admit_vllm(
    waiting: Sequence[PoolEntry], running: Sequence[PoolEntry], capacity_slots: int
) -> list[str]:
    """vLLM: admit in order while each request's tokens to compute now fit the free slots."""
    num_free = num_free_slots(running, capacity_slots)
    admitted = []
    for entry in waiting:
        if entry.num_tokens_to_compute > num_free:
            break
        num_free -= entry.num_tokens_to_compute
        admitted.append(entry.request.request_id)
    return admitted


def admit_sglang(
    waiting: Sequence[PoolEntry],
    running: Sequence[PoolEntry],
    capacity_slots: int,
    new_token_ratio: float = SGLANG_INIT_NEW_TOKEN_RATIO,
    clip_max_new_tokens: int = SGLANG_CLIP_MAX_NEW_TOKENS,
) -> list[str]:
    """SGLang's PrefillAdder: a running request is expected to use new_token_ratio of its
    remaining max_tokens; a new one books its prompt and all of its (clipped) max_tokens.

        offset = sum over running of min(remaining, clip) * new_token_ratio
        admit while prompt + min(remaining, clip) < free - offset, then offset += that amount
    """
    num_free = num_free_slots(running, capacity_slots)
    offset = sum(min(e.num_remaining_tokens, clip_max_new_tokens) for e in running)
    offset *= new_token_ratio
    admitted = []
    for entry in waiting:
        total = entry.num_tokens_to_compute + min(entry.num_remaining_tokens, clip_max_new_tokens)
        if total >= num_free - offset:
            break
        offset += total
        admitted.append(entry.request.request_id)
    return admitted


def admit_trtllm(
    waiting: Sequence[PoolEntry], running: Sequence[PoolEntry], capacity_slots: int
) -> list[str]:
    """TensorRT-LLM GUARANTEED_NO_EVICT: every request reserves prompt + max_tokens slots, the
    most it can ever hold. Admit in order while the reservations fit the pool."""
    num_unreserved = capacity_slots - sum(
        e.request.num_prompt_tokens + e.request.max_tokens for e in running
    )
    admitted = []
    for entry in waiting:
        need = entry.request.num_prompt_tokens + entry.request.max_tokens
        if need > num_unreserved:
            break
        num_unreserved -= need
        admitted.append(entry.request.request_id)
    return admitted


def eviction_victim(policy: str, running: Sequence[PoolEntry]) -> PoolEntry:
    """Whom to evict when running requests (in admission order) outgrow the pool.

    vLLM preempts the newest request. SGLang retracts the request with the fewest output
    tokens, and among equals the one with the longest prompt. TensorRT-LLM's
    GUARANTEED_NO_EVICT never gets here.
    """
    if policy == "vllm":
        return running[-1]
    if policy == "sglang":
        return min(running, key=lambda e: (e.num_generated, -e.request.num_prompt_tokens))
    raise ValueError(f"{policy} never evicts a running request")


@dataclass(slots=True)
class PoolStep:
    """One step of `simulate_pool`."""

    step: int
    admitted: list[str]
    evicted: list[str]  # preempted (vLLM) or retracted (SGLang) in this step
    running: list[str]  # after admission
    num_used_slots: int  # held by the running requests, once admission is done
    new_token_ratio: float | None  # SGLang only


@dataclass(slots=True)
class PoolRun:
    """A whole workload under one admission rule."""

    policy: str
    capacity_slots: int
    steps: list[PoolStep] = field(default_factory=list)
    finish_steps: dict[str, int] = field(default_factory=dict)
    num_recomputed_tokens: int = 0  # prefill work spent again on evicted requests

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def num_evictions(self) -> int:
        return sum(len(s.evicted) for s in self.steps)

    @property
    def mean_running(self) -> float:
        return sum(len(s.running) for s in self.steps) / max(len(self.steps), 1)

    @property
    def mean_usage(self) -> float:
        """Mean fraction of the pool holding KV over the run."""
        used = sum(s.num_used_slots for s in self.steps)
        return used / (max(len(self.steps), 1) * self.capacity_slots)


def simulate_pool(
    policy: str,
    requests: Sequence[PoolRequest],
    capacity_slots: int,
    max_num_seqs: int | None = None,
    new_token_ratio: float = SGLANG_INIT_NEW_TOKEN_RATIO,
) -> PoolRun:
    """Run `requests` (all queued at step 0, in this order) through one pool under `policy`.

    Every step: (1) if the running requests hold more slots than the pool has (each took one
    for the token it sampled last step), requests are evicted by the policy's rule until they
    fit; (2) unless the step evicted, waiting requests are admitted by the policy's rule and
    prefill whole; (3) every running request samples one token, and those that reach their
    num_output_tokens finish and free their slots. `new_token_ratio` is SGLang's starting
    forecast; it decays every step without retraction and is re-estimated after one.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for r in requests:
        if r.num_prompt_tokens + r.max_tokens >= capacity_slots:
            raise ValueError(
                f"request {r.request_id!r} needs {r.num_prompt_tokens + r.max_tokens} slots at "
                f"most; the pool must be larger than that, got {capacity_slots}"
            )
    max_num_seqs = max_num_seqs or len(requests)
    min_ratio = new_token_ratio * SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    ratio_decay = (new_token_ratio - min_ratio) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    waiting = [PoolEntry(r) for r in requests]
    running: list[PoolEntry] = []  # in admission order
    run = PoolRun(policy, capacity_slots)

    while waiting or running:
        # (1) the slots of last step's tokens: evict until the running requests fit
        evicted: list[PoolEntry] = []
        while num_free_slots(running, capacity_slots) < 0:
            victim = eviction_victim(policy, running)
            running.remove(victim)
            evicted.append(victim)
        if policy == "vllm":
            waiting[:0] = evicted  # back to the front of the queue
        else:
            waiting.extend(evicted)  # back to the end of the queue
        if policy == "sglang":
            if evicted:
                decoded = sum(e.num_generated for e in running)
                max_new = sum(e.request.max_tokens for e in running)
                estimate = (decoded + SGLANG_RETRACT_DECODE_STEPS * len(running)) / max(max_new, 1)
                new_token_ratio = min(1.0, estimate)
            else:
                new_token_ratio = max(new_token_ratio - ratio_decay, min_ratio)

        idle = not running
        # (2) admission, unless this step had to evict
        admitted_ids: list[str] = []
        if not evicted:
            seats = max_num_seqs - len(running)
            if policy == "vllm":
                admitted_ids = admit_vllm(waiting[:seats], running, capacity_slots)
            elif policy == "sglang":
                admitted_ids = admit_sglang(
                    waiting[:seats], running, capacity_slots, new_token_ratio
                )
            else:
                admitted_ids = admit_trtllm(waiting[:seats], running, capacity_slots)
        admitted = waiting[: len(admitted_ids)]
        del waiting[: len(admitted_ids)]
        running.extend(admitted)
        run.num_recomputed_tokens += sum(
            e.num_tokens_to_compute for e in admitted if e.num_generated
        )
        used = capacity_slots - num_free_slots(running, capacity_slots)

        # (3) every running request samples a token; finished ones leave
        for entry in running:
            entry.num_generated += 1
        run.steps.append(
            PoolStep(
                step=len(run.steps),
                admitted=admitted_ids,
                evicted=[e.request.request_id for e in evicted],
                running=[e.request.request_id for e in running],
                num_used_slots=used,
                new_token_ratio=new_token_ratio if policy == "sglang" else None,
            )
        )
        for entry in [e for e in running if e.num_generated == e.request.num_output_tokens]:
            running.remove(entry)
            run.finish_steps[entry.request.request_id] = len(run.steps) - 1
        if idle and not admitted_ids:
            raise RuntimeError(f"{policy}: the pool is empty but nothing can be admitted")
    return run


def admitted_at_start(policy: str, requests: Sequence[PoolRequest], capacity_slots: int) -> int:
    """How many of `requests`, queued on an empty pool, the policy admits in its first step."""
    waiting = [PoolEntry(r) for r in requests]
    if policy == "vllm":
        return len(admit_vllm(waiting, [], capacity_slots))
    if policy == "sglang":
        return len(admit_sglang(waiting, [], capacity_slots))
    if policy == "trtllm":
        return len(admit_trtllm(waiting, [], capacity_slots))
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def sglang_min_new_token_ratio(init: float = SGLANG_INIT_NEW_TOKEN_RATIO) -> float:
    """The floor the forecast decays to: init * SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR."""
    return init * SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
