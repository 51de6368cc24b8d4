"""What the engine hands back: per step from the model runner, per request to the user.

`SampledToken` is the model runner's answer for one sequence in one step. `RequestOutput`
(one per prompt) and `CompletionOutput` (one per completion of that prompt, `n` of them) are
the public results, with vLLM's names and fields. A completion's text is what the user may see
now: while a stop string could still be forming at its end, that end is held back.
`RequestMetrics` is the request's timestamps and the latencies derived from them (TTFT, ITL,
E2EL, TPOT: see `minillm.core.metrics`), which a `RequestOutput` carries.

This module imports nothing of the engine, so every layer may use these values.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass(slots=True)
class RequestMetrics:
    """The timestamps of one request (seconds, one clock) and the latencies derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finished_time: float | None = None

    def record_scheduled(self, now: float) -> None:
        # a preempted request is scheduled again later; its queueing time ends the first time
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def record_token(self, now: float) -> None:
        self.token_times.append(now)

    def record_finished(self, now: float) -> None:
        self.finished_time = now

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def queueing_time_s(self) -> float | None:
        """Time spent waiting before the scheduler first gave the request any tokens."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to the first sampled token (queueing + prefill)."""
        if not self.token_times:
            return None
        return self.token_times[0] - self.arrival_time

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the n - 1 gaps between consecutive output tokens."""
        return [later - earlier for earlier, later in pairwise(self.token_times)]

    @property
    def e2el_s(self) -> float | None:
        """End-to-end latency: arrival to finish."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2EL - TTFT) / (n - 1).

        This is the TPOT that vLLM's benchmark reports per request. For one request that
        finishes on its last token it equals `mean_itl_s`. Averaged over many requests the two
        conventions differ: the mean of per-request TPOTs weighs every request equally, while
        the mean over all ITL gaps of all requests weighs every token equally, so long requests
        count for more.
        """
        e2el_s, ttft_s = self.e2el_s, self.ttft_s
        if e2el_s is None or ttft_s is None or self.num_output_tokens < 2:
            return None
        return (e2el_s - ttft_s) / (self.num_output_tokens - 1)

    @property
    def mean_itl_s(self) -> float | None:
        """The mean of this request's ITL gaps (the token-weighted convention, for one request)."""
        gaps = self.itl_s
        return statistics.fmean(gaps) if gaps else None


@dataclass(slots=True)
class SampledToken:
    """The token sampled for one sequence in one step."""

    token_id: int
    # {token_id: logprob} of the sampled token and the top-n, when the request asked for them
    logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt, as far as it has got."""

    index: int  # which of the n completions
    text: str  # all text so far (cut at a stop string)
    token_ids: list[int]  # all output token ids so far, stop tokens included
    logprobs: list[dict[int, float]] | None  # per output token, when asked for
    finish_reason: str | None  # "stop", "length", "abort", or None while generating
    stop_reason: int | str | None  # the stop token id or stop string; None for EOS or length
    delta_text: str = ""  # text added since the previous output of this completion

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A prompt and its completions, as far as they have got."""

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool  # every completion has finished
    metrics: RequestMetrics  # the whole request's timestamps (see merge_request_metrics)
    error: str | None = None  # why the engine aborted the request, when a step failed on it
