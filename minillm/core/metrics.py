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

`RequestMetrics`, the record of one request, is defined in `minillm.outputs`, beside the
`RequestOutput` that hands it to the user (so that the public outputs depend on nothing of the
engine's), and is imported here; this module adds the averages over many requests and the
scheduler's per-step `StepTrace`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from minillm.outputs import RequestMetrics

__all__ = [
    "RequestMetrics",
    "StepTrace",
    "mean_itl_s",
    "mean_tpot_s",
    "merge_request_metrics",
]


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
