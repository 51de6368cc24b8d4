"""Beam search as vLLM (V1) offers it: outside the scheduler, on top of ordinary requests.

Every step, each live beam of every prompt is one request of one token (max_tokens=1) that
asks for the 2 * beam_width most likely next tokens (logprobs). The candidates (beam + token)
of a prompt are ranked by get_beam_search_score and the best beam_width go on; every
candidate ending in EOS is finished and set aside. After max_tokens steps the finished and the live
beams are ranked together and the best beam_width are returned.

The beams share the paged KV cache through prefix caching: a beam's request is its parent's
tokens plus one, so its full blocks are found by hash and only the tail is recomputed; the
partly filled last block is copied (copy-on-write happens when a cached prefix is extended).
Scores use the logprobs the engine reports (raw logprobs by default, as in vLLM V1), so
`temperature` changes nothing there; it is passed to the requests as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from minillm.sampling_params import BeamSearchParams, SamplingParams


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: its tokens (prompt included, as in vLLM), the logprobs dict of each generated
    token, and the sum of the generated tokens' logprobs."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int],
    cumulative_logprob: float,
    eos_token_id: int | None,
    length_penalty: float,
) -> float:
    """vLLM's score: cumulative_logprob / len(tokens) ** length_penalty, the length counting
    the prompt and not a final EOS. length_penalty > 1 favours longer sequences (their
    negative sum is divided by more), < 1 shorter ones, 0 ranks by the sum alone."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def beam_search(
    generate,
    prompts: list[list[int]],
    params: BeamSearchParams,
    eos_token_id,
    decode,
    max_model_len: int | None = None,
) -> list[BeamSearchOutput]:
    """Run the search. generate(prompts, sampling_params) -> RequestOutputs is the engine's
    batched generate; prompts are token ids; decode(token_ids) -> text. A beam that fills
    max_model_len finishes there with finish_reason "length", as generate's requests do."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    width = params.beam_width
    sampling = SamplingParams(
        max_tokens=1,
        logprobs=2 * width,
        temperature=params.temperature,
        ignore_eos=params.ignore_eos,
        skip_special_tokens=True,
    )

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(
            beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty
        )

    live = [[BeamSearchSequence(tokens=list(prompt))] for prompt in prompts]
    finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        if max_model_len is not None:
            for i, beams in enumerate(live):
                full = [beam for beam in beams if len(beam.tokens) >= max_model_len]
                for beam in full:
                    beam.finish_reason = "length"
                finished[i] += full
                live[i] = [beam for beam in beams if len(beam.tokens) < max_model_len]
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outputs = generate([beam.tokens for _, beam in flat], sampling)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), output in zip(flat, outputs, strict=True):
            [step_logprobs] = output.outputs[0].logprobs
            for token_id, logprob in step_logprobs.items():
                candidates[i].append(
                    BeamSearchSequence(
                        tokens=[*beam.tokens, token_id],
                        logprobs=[*beam.logprobs, step_logprobs],
                        cum_logprob=beam.cum_logprob + logprob,
                    )
                )
        for i, options in enumerate(candidates):
            # vLLM's rule: every candidate that ends in EOS is finished, whatever its rank;
            # the best beam_width of the others go on
            going_on = []
            for beam in options:
                if beam.tokens[-1] == eos_token_id and not params.ignore_eos:
                    beam.finish_reason = "stop"
                    finished[i].append(beam)
                else:
                    going_on.append(beam)
            live[i] = sorted(going_on, key=score, reverse=True)[:width]
    results = []
    for i, prompt in enumerate(prompts):
        for beam in live[i]:
            beam.finish_reason = "length"
        best = sorted(finished[i] + live[i], key=score, reverse=True)[:width]
        for beam in best:
            generated = beam.tokens[len(prompt) :]
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = decode(generated)
        results.append(BeamSearchOutput(best))
    return results
