"""The output processor: from the engine's requests to what the user sees.

After every step the engine hands the requests that progressed to these functions. They turn
a request's tokens and text into the public `CompletionOutput`, hold back text that may still
become a stop string, and compute the delta since the previous output for streaming.
"""

from __future__ import annotations

from minillm.core.request import Request
from minillm.outputs import CompletionOutput


def make_completion_output(seq: Request) -> CompletionOutput:
    """The sequence's output so far, and the text added since the last one (delta_text)."""
    text = visible_text(seq)
    delta_text = text[seq.num_streamed_chars :]
    seq.num_streamed_chars = len(text)
    params = seq.sampling_params
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=list(seq.output_token_ids),
        logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
        finish_reason=seq.status.finish_reason,
        stop_reason=seq.stop_reason,
        delta_text=delta_text,
    )


def visible_text(seq: Request) -> str:
    """The output text a user may see now.

    While a request with stop strings runs, the last (longest stop string - 1) characters are
    held back: they may be the start of a stop string, which would be cut from the text once
    the rest arrives. Streamed text is therefore never taken back (vLLM does the same).
    """
    stop = seq.sampling_params.stop
    if seq.is_finished or not stop:
        return seq.output_text
    num_held_back = max(len(s) for s in stop) - 1
    return seq.output_text[: max(0, len(seq.output_text) - num_held_back)]
