"""`Request`: one sequence the engine is generating, from arrival to finish.

A request is a prompt, the tokens generated for it so far, and how many of those tokens
already have keys and values in the KV cache (`num_computed_tokens`). The scheduler moves it
between the waiting queue and the running batch; its status says where it is:

    WAITING -> RUNNING -> FINISHED_*          (the usual life)
    RUNNING -> PREEMPTED -> RUNNING           (blocks ran out; its KV is recomputed later)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minillm.core.metrics import RequestMetrics
from minillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minillm.model.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # a stop token, EOS or stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in FINISH_REASONS

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
    """One sequence: prompt, output so far, KV-cache progress, and what to do next."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    index: int = 0  # which of the prompt's sampling_params.n completions this sequence is
    priority: int = 0  # scheduling_policy="priority": lower values are served first (vLLM's rule)
    generator: torch.Generator | None = None  # its own random stream when seeded
    detokenizer: IncrementalDetokenizer | None = None  # None: token ids only, no text
    output_token_ids: list[int] = field(default_factory=list)
    # per output token, {token_id: logprob} of the sampled token and the top-n, when asked for
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    output_text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    # n > 1: the other completions, forked from this one once its prompt is computed
    pending_forks: list[Request] = field(default_factory=list)
    num_streamed_chars: int = 0  # how much of output_text has been handed out as deltas
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output so far: what a preempted request recomputes as its prompt."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_seqs(self) -> int:
        """Sequences this request will occupy in the batch: itself plus its pending forks."""
        return 1 + len(self.pending_forks)

    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def detokenize_last_token(self) -> str:
        """Add the last output token's text to output_text; return the new characters."""
        if self.detokenizer is None:
            return ""
        new_text = self.detokenizer.add_token(self.output_token_ids[-1])
        self.output_text += new_text
        return new_text
