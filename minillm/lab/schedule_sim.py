"""The scheduler without a model: which request runs in which step, in microseconds.

`simulate_schedule` drives minillm's own `Scheduler` and `KVCacheManager` on requests that
arrive at given steps (all at once by default), with a stand-in for the model runner that
samples a token that never stops a request. Each request therefore produces exactly its
`num_output_tokens`, and the step traces are the ones the engine would record for the same
requests and options: the schedule depends on token counts, not on what the tokens are.
Chapters use it to count steps and to draw schedules too large to run through a model on a
laptop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.metrics import StepTrace
from minillm.core.request import Request
from minillm.core.scheduler import Scheduler
from minillm.outputs import SampledToken
from minillm.sampling_params import SamplingParams

# the token every simulated step samples; no simulated request has a stop token
SIMULATED_TOKEN_ID = 0


@dataclass(slots=True, frozen=True)
class SimRequest:
    """A request by its sizes: how many prompt tokens, and how many tokens it will generate;
    optionally the step before which it arrives, and its priority (scheduling_policy="priority")."""

    num_prompt_tokens: int
    num_output_tokens: int
    arrival_step: int = 0
    priority: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1 or self.num_output_tokens < 1:
            raise ValueError(
                "a simulated request needs at least one prompt token and one output token, "
                f"got {self.num_prompt_tokens} and {self.num_output_tokens}"
            )
        if self.arrival_step < 0:
            raise ValueError(f"arrival_step must be >= 0, got {self.arrival_step}")


@dataclass(slots=True)
class ScheduleSim:
    """What the scheduler did with the requests: one trace per step, and when each finished."""

    traces: list[StepTrace]
    finish_steps: list[int]  # per request, the step in which it sampled its last token
    first_token_steps: list[int]  # per request, the step in which it sampled its first token

    @property
    def num_steps(self) -> int:
        return len(self.traces)


def simulate_schedule(
    requests: Sequence[SimRequest | tuple[int, int]],
    max_num_seqs: int,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
    num_blocks: int | None = None,
    enable_chunked_prefill: bool = True,
    scheduling_policy: str = "fcfs",
    batching_type: str = "continuous",
) -> ScheduleSim:
    """Schedule `requests` until all have finished. Request i gets the id str(i) and arrives just
    before step `arrival_step` (requests arriving together queue in the order given).

    Each request has prompt token ids of its own, so the prefix cache never hits. num_blocks
    defaults to room for every request at its full length (no preemption). A step with nothing
    to run (every request so far has finished) is traced with an empty plan.
    """
    sims = [r if isinstance(r, SimRequest) else SimRequest(*r) for r in requests]
    if not sims:
        return ScheduleSim(traces=[], finish_steps=[], first_token_steps=[])
    max_model_len = max(r.num_prompt_tokens + r.num_output_tokens for r in sims)
    if num_blocks is None:
        num_blocks = sum(
            math.ceil((r.num_prompt_tokens + r.num_output_tokens) / block_size) for r in sims
        )
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        clock=lambda: 0.0,
        scheduling_policy=scheduling_policy,
        batching_type=batching_type,
    )
    requests_in_order: list[Request] = []
    next_token_id = SIMULATED_TOKEN_ID + 1
    for i, sim in enumerate(sims):
        prompt = list(range(next_token_id, next_token_id + sim.num_prompt_tokens))
        next_token_id += sim.num_prompt_tokens
        params = SamplingParams(max_tokens=sim.num_output_tokens, ignore_eos=True)
        request = Request(str(i), prompt, params, arrival_time=float(sim.arrival_step))
        request.priority = sim.priority
        requests_in_order.append(request)

    traces: list[StepTrace] = []
    finish_steps = [-1] * len(sims)
    first_token_steps = [-1] * len(sims)
    arrivals = sorted(range(len(sims)), key=lambda i: sims[i].arrival_step)  # stable
    while arrivals or scheduler.has_unfinished_requests():
        while arrivals and sims[arrivals[0]].arrival_step <= scheduler.num_steps:
            scheduler.add_request(requests_in_order[arrivals.pop(0)])
        busy = scheduler.has_unfinished_requests()
        output = scheduler.schedule()
        if busy and not output.scheduled:
            raise RuntimeError(
                f"step {output.step} scheduled nothing: these options cannot serve the requests"
            )
        sampled = {
            s.request.request_id: SampledToken(SIMULATED_TOKEN_ID)
            for s in output.scheduled
            if s.samples
        }
        for request in scheduler.update_from_output(output, sampled):
            index = int(request.request_id)
            if request.num_output_tokens == 1:
                first_token_steps[index] = output.step
            if request.is_finished:
                finish_steps[index] = output.step
        traces.append(output.trace())
    return ScheduleSim(
        traces=traces, finish_steps=finish_steps, first_token_steps=first_token_steps
    )
