"""Latency metrics of one request, and counters of the whole engine.

A request records when it arrived, when the scheduler first gave it tokens, when each output
token came out of the sampler (the first of them is the first token), and when it finished.
Every latency the book uses is a difference of these:

    queueing time  = first scheduled - arrival
    TTFT           = first token - arrival                (time to first token)
    ITL            = token[i] - token[i - 1], i = 1 .. n-1 (inter-token latency, one per gap)
    E2EL           = finished - arrival                   (end-to-end latency)
    TPOT           = (E2EL - TTFT) / (n - 1)              (time per output token)

Timestamps come from `time.perf_counter` in the engine; tests pass their own values.
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


def mean_tpot_s(metrics: list[RequestMetrics]) -> float | None:
    """TPOT averaged per request: every request counts once (vLLM benchmark's "Mean TPOT")."""
    values = [m.tpot_s for m in metrics if m.tpot_s is not None]
    return statistics.fmean(values) if values else None


def mean_itl_s(metrics: list[RequestMetrics]) -> float | None:
    """ITL averaged over all gaps of all requests: every token counts once ("Mean ITL")."""
    gaps = [gap for m in metrics for gap in m.itl_s]
    return statistics.fmean(gaps) if gaps else None


@dataclass(slots=True)
class StepTrace:
    """What one scheduler step did: per request, how many tokens and whether prefill or decode."""

    step: int
    scheduled: list[tuple[str, int, str]]  # (request_id, num_new_tokens, "prefill" | "decode")
    preempted: list[str]  # request ids preempted in this step
    num_waiting: int = 0  # requests left waiting once the step was planned


def merge_request_metrics(metrics: list[RequestMetrics]) -> RequestMetrics:
    """The timestamps of a whole request from those of its n completions.

    With n = 1 that is the completion's own record. With n > 1 the request arrives once,
    is first scheduled when its first completion is, produces output at every time any
    completion produces a token (one token time per step, however many completions sampled
    in it: the completions advance together, so TPOT is the time per position), and
    finishes when its last completion does.
    """
    if len(metrics) == 1:
        return metrics[0]
    scheduled = [m.first_scheduled_time for m in metrics if m.first_scheduled_time is not None]
    finished = [m.finished_time for m in metrics]
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in metrics),
        first_scheduled_time=min(scheduled) if scheduled else None,
        token_times=sorted({t for m in metrics for t in m.token_times}),
        finished_time=None if None in finished else max(finished),
    )
