"""What the engine hands back: per step from the model runner, per request to the user.

`SampledToken` is the model runner's answer for one sequence in one step. `RequestOutput`
(one per prompt) and `CompletionOutput` (one per completion of that prompt, `n` of them) are
the public results, with vLLM's names and fields. A completion's text is what the user may see
now: while a stop string could still be forming at its end, that end is held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.core.metrics import RequestMetrics


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
