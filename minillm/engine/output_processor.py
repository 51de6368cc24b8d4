"""The output processor: from the engine's token ids to what the user sees.

The scheduler deals in token ids only. After every step the engine hands the sequences that
got new tokens to the output processor, which

- detokenizes each new token incrementally (a token may hold part of a UTF-8 character);
- searches the new text for the request's stop strings, cuts the text there, and reports the
  hit, so that the engine finishes the request in the same step;
- holds back the end of the text while it could still become a stop string, so that streamed
  text is never taken back;
- builds one `RequestOutput` per prompt that made progress, with the text added since the
  previous output (`delta_text`) for streaming: everything so far, only what is new, or
  nothing until the prompt finishes, as its `output_kind` asks.

It also owns the registry of requests the engine is serving: a prompt and its n sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minillm.core.metrics import merge_request_metrics
from minillm.core.request import Request, RequestStatus
from minillm.model.tokenizer import INITIAL_PREFIX_TOKENS, IncrementalDetokenizer, Tokenizer
from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import RequestOutputKind


@dataclass(slots=True, eq=False)
class SequenceText:
    """The text of one completion, as far as it has been detokenized."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_detokenized: int = 0  # output tokens already turned into text (or skipped)
    num_streamed_chars: int = 0  # how much of `text` has been handed out as deltas
    num_streamed_tokens: int = 0  # output tokens handed out (RequestOutputKind.DELTA)


@dataclass(slots=True, eq=False)
class RequestState:
    """A prompt the engine serves: its n sequences and their texts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request] = field(default_factory=list)
    texts: list[SequenceText] = field(default_factory=list)
    error: str | None = None  # why the engine aborted it, when it did

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class OutputProcessor:
    """Detokenization, stop strings, hold-back and streaming deltas for every request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # unfinished prompts, by request id
        self.state_of_seq: dict[str, RequestState] = {}  # the same, by their sequences' ids
        self.to_report: list[RequestState] = []  # finished from outside since the last step

    def add_request(self, request_id: str, prompt: str | None, seqs: list[Request]) -> RequestState:
        prompt_token_ids = seqs[0].prompt_token_ids
        state = RequestState(request_id, prompt, prompt_token_ids, seqs)
        # the detokenizer needs only the last few prompt tokens as context
        context = prompt_token_ids[-INITIAL_PREFIX_TOKENS:]
        for seq in seqs:
            skip_special = seq.sampling_params.skip_special_tokens
            state.texts.append(
                SequenceText(IncrementalDetokenizer(self.tokenizer, context, skip_special))
            )
        self.states[request_id] = state
        self.state_of_seq.update((seq.request_id, state) for seq in seqs)
        return state

    def is_in_use(self, request_id: str, seq_ids: list[str]) -> bool:
        return request_id in self.states or any(i in self.state_of_seq for i in seq_ids)

    def detokenize(
        self, progressed: list[Request]
    ) -> tuple[list[tuple[Request, str]], list[tuple[Request, str]]]:
        """Turn the new tokens of each progressed sequence into text.

        Returns the (sequence, stop string) pairs whose text reached a stop string in this
        step, which the caller finishes, and the (sequence, error) pairs whose text could not
        be made, which the caller aborts: one failing request costs the others nothing.
        """
        stopped: list[tuple[Request, str]] = []
        failed: list[tuple[Request, str]] = []
        for seq in progressed:
            state = self.state_of_seq[seq.request_id]
            try:
                stop = detokenize_new_tokens(seq, state.texts[seq.index])
            except Exception as error:  # noqa: BLE001 - reported with the request
                failed.append((seq, f"{type(error).__name__}: {error}"))
                continue
            if stop is not None:
                stopped.append((seq, stop))
        return stopped, failed

    def report(self, state: RequestState) -> None:
        """Report a request finished from outside the step (abort) in the next outputs, and
        let its id be used again at once."""
        self.to_report.append(state)
        self._forget(state)

    def make_outputs(self, progressed: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per prompt that got a new token or finished since the last step
        (a prompt that asked for its final output only: once it has finished)."""
        states, self.to_report = self.to_report, []
        seen = {id(state) for state in states}
        for seq in progressed:
            state = self.state_of_seq.get(seq.request_id)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                final_only = seq.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
                if state.finished or not final_only:
                    states.append(state)
        outputs = [make_request_output(state) for state in states]
        for state in states:
            if state.finished:
                self._forget(state)
        return outputs

    def _forget(self, state: RequestState) -> None:
        """A finished prompt's ids may be used again (by identity: the id may already be
        someone else's)."""
        if self.states.get(state.request_id) is state:
            del self.states[state.request_id]
        for seq in state.seqs:
            if self.state_of_seq.get(seq.request_id) is state:
                del self.state_of_seq[seq.request_id]


def detokenize_new_tokens(seq: Request, text: SequenceText) -> str | None:
    """Detokenize the sequence's new output tokens; return the stop string its text reached.

    A sequence the scheduler just stopped on a stop token (EOS or stop_token_ids) leaves that
    token's text out unless include_stop_str_in_output, and is not searched for stop strings
    (vLLM's order: stop tokens first). Otherwise each new piece of text is searched for the
    stop strings once min_tokens tokens are out, and the text is cut at the stop string (or
    after it, when it is to be included).
    """
    params = seq.sampling_params
    tokens, first = seq.all_token_ids, seq.num_prompt_tokens  # output token i: tokens[first + i]
    num_output = len(tokens) - first
    stopped_on_token = seq.status == RequestStatus.FINISHED_STOPPED and not isinstance(
        seq.stop_reason, str
    )
    for i in range(text.num_detokenized, num_output):
        is_last = i == num_output - 1
        text.num_detokenized = i + 1
        if is_last and stopped_on_token and not params.include_stop_str_in_output:
            return None
        new_text = text.detokenizer.add_token(tokens[first + i])
        text.text += new_text
        if is_last and stopped_on_token:
            return None
        if new_text and params.stop and i + 1 >= params.min_tokens:
            stop = find_stop_string(text.text, len(new_text), params.stop)
            if stop is not None:
                stop_str, stop_index = stop
                if params.include_stop_str_in_output:
                    stop_index += len(stop_str)
                text.text = text.text[:stop_index]
                _drop_tokens_after(seq, i)
                return stop_str
    return None


def _drop_tokens_after(seq: Request, index: int) -> None:
    """The output ends with token `index`, the one that completed a stop string: tokens a
    step appended after it (speculative decoding's accepted drafts, jump-forward's forced run)
    are dropped, so token_ids, usage and logprobs are those of decoding one token a step."""
    num_after = seq.num_output_tokens - (index + 1)
    if num_after <= 0:
        return
    if len(seq.output_logprobs) == seq.num_output_tokens:
        del seq.output_logprobs[index + 1 :]
    del seq.all_token_ids[seq.num_prompt_tokens + index + 1 :]


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends within the last `num_new_chars` characters of `text`, and
    where it starts. Only a match touching the new characters is new: earlier text was searched
    on earlier tokens."""
    for stop_str in stop:
        start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        stop_index = text.find(stop_str, start)
        if stop_index != -1:
            return stop_str, stop_index
    return None


def visible_text(seq: Request, text: SequenceText) -> str:
    """The output text a user may see now.

    While a request with stop strings runs, the last (longest stop string - 1) characters are
    held back: they may be the start of a stop string, which would be cut from the text once
    the rest arrives. Streamed text is therefore never taken back (vLLM does the same).
    """
    stop = seq.sampling_params.stop
    if seq.is_finished or not stop:
        return text.text
    num_held_back = max(len(s) for s in stop) - 1
    return text.text[: max(0, len(text.text) - num_held_back)]


def make_completion_output(seq: Request, text: SequenceText) -> CompletionOutput:
    """The sequence's output so far, and the text added since the last one (delta_text);
    with RequestOutputKind.DELTA only what was added since the last one."""
    shown = visible_text(seq, text)
    delta_text = shown[text.num_streamed_chars :]
    text.num_streamed_chars = len(shown)
    params = seq.sampling_params
    first_token = 0
    if params.output_kind == RequestOutputKind.DELTA:
        first_token, text.num_streamed_tokens = text.num_streamed_tokens, seq.num_output_tokens
    return CompletionOutput(
        index=seq.index,
        text=delta_text if params.output_kind == RequestOutputKind.DELTA else shown,
        token_ids=seq.all_token_ids[seq.num_prompt_tokens + first_token :],
        logprobs=list(seq.output_logprobs[first_token:]) if params.logprobs is not None else None,
        finish_reason=seq.status.finish_reason,
        stop_reason=seq.stop_reason,
        delta_text=delta_text,
    )


def make_request_output(state: RequestState) -> RequestOutput:
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[
            make_completion_output(seq, text)
            for seq, text in zip(state.seqs, state.texts, strict=True)
        ],
        finished=state.finished,
        metrics=merge_request_metrics([seq.metrics for seq in state.seqs]),
        error=state.error,
    )
