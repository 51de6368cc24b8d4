"""`Request`: one sequence the engine is generating, from arrival to finish.

A request is a prompt, the tokens generated for it so far, and how many of those tokens
already have keys and values in the KV cache (`num_computed_tokens`). The scheduler moves it
between the waiting queue and the running batch; its status says where it is:

    WAITING -> RUNNING -> FINISHED_*          (the usual life)
    RUNNING -> PREEMPTED -> RUNNING           (blocks ran out; its KV is recomputed later)
    RUNNING -> WAITING_FOR_REMOTE_KVS -> RUNNING
                      (disaggregation: its prompt ran on the prefill instance; its first
                       token and KV are on their way to the decode instance)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minillm.core.metrics import RequestMetrics
from minillm.lora.request import LoRARequest
from minillm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # vLLM V1's name: KV still in transfer
    FINISHED_STOPPED = enum.auto()  # a stop token, EOS or stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        # identity tests: cheaper than hashing the member, and asked several times per step
        return (
            self is RequestStatus.FINISHED_STOPPED
            or self is RequestStatus.FINISHED_LENGTH
            or self is RequestStatus.FINISHED_ABORTED
        )

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish_reason: "stop", "length", "abort", or None while running."""
        return FINISH_REASONS.get(self)


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


# eq=False: requests compare by identity, as list membership in the queues needs
@dataclass(slots=True, eq=False)
class Request:
    """One sequence: prompt, output so far, KV-cache progress, and what to do next.

    Its tokens live in one list, `all_token_ids` (prompt, then output), appended to as tokens
    are sampled: the scheduler, the KV-cache manager and the model runner all read that list.
    Text is not kept here: the engine's output processor turns tokens into text.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    index: int = 0  # which of the prompt's sampling_params.n completions this sequence is
    priority: int = 0  # scheduling_policy="priority": lower values are served first (vLLM's rule)
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with; None: base model
    all_token_ids: list[int] = field(init=False)  # prompt, then output: the one list of tokens
    # per output token, {token_id: logprob} of the sampled token and the top-n, when asked for
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    # n > 1: the other completions, forked from this one when its prompt's last chunk is planned
    pending_forks: list[Request] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far (a copy)."""
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_seqs(self) -> int:
        """Sequences this request will occupy in the batch: itself plus its pending forks."""
        return 1 + len(self.pending_forks)

    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
