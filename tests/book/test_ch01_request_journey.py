"""The checks of chapter 1's exercises reject plausible wrong answers.

As in test_ch00_conventions: the solution's non-graded cells run in this process (they load
the bundled model), then each graded cell runs with the solution (it must pass), with the
stub (NotImplementedError), and with each wrong answer (it must fail).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from .conftest import ROOT
from .exercise_checks import (
    ExerciseChecks,
    FromNamespace,
    exercise_namespace,
    run_cell,
    wrong_in_place,
)


def greedy_loop(model, prompt_ids, max_tokens, position=-1, keep_prompt=False, inference_mode=True):
    """A no-cache greedy loop with a knob for each mistake."""
    token_ids = list(prompt_ids)
    with torch.inference_mode(inference_mode):
        for _ in range(max_tokens):
            logits = model.forward_causal(torch.tensor([token_ids]))
            token_ids.append(int(logits[0, position].argmax()))
    return token_ids if keep_prompt else token_ids[len(prompt_ids) :]


def static_batches(num_output_tokens, max_num_seqs):
    """Static batching: the next batch starts only when the whole batch has finished."""
    finish, start = [], 0
    for i in range(0, len(num_output_tokens), max_num_seqs):
        batch = num_output_tokens[i : i + max_num_seqs]
        finish += [start + n - 1 for n in batch]
        start += max(batch)
    return finish


def seats(num_output_tokens, max_num_seqs, delay):
    """Continuous batching where a freed seat is taken `delay` steps after the finish."""
    free_at, finish = [0] * max_num_seqs, []
    for n in num_output_tokens:
        seat = min(range(max_num_seqs), key=lambda s: free_at[s])
        finish.append(free_at[seat] + n - 1)
        free_at[seat] = free_at[seat] + n - 1 + delay
    return finish


def round_robin_seats(num_output_tokens, max_num_seqs):
    """Request i always waits for seat i % max_num_seqs, even when another is free earlier."""
    free_at, finish = [0] * max_num_seqs, []
    for i, n in enumerate(num_output_tokens):
        seat = i % max_num_seqs
        finish.append(free_at[seat] + n - 1)
        free_at[seat] += n
    return finish


def decode_each(tokenizer, ids):
    return [tokenizer.decode([t]) for t in ids]


def never_hold_back(tokenizer, ids):
    pieces, emitted = [], ""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i])
        pieces.append(text[len(emitted) :])
        emitted = text
    return pieces


def all_at_the_end(tokenizer, ids):
    return [""] * (len(ids) - 1) + [tokenizer.decode(ids)] if ids else []


def finish_with(order, cut=True, count_stop_token=True, earliest=False):
    """A finish() with the checks in `order` ("eos", "stop", "length"), and three more knobs:
    `earliest` takes the stop string that starts first in the text, not the first listed."""

    def finish(tokenizer, token_ids, eos_token_id, stop, max_tokens):
        for num_tokens in range(1, len(token_ids) + 1):
            text = tokenizer.decode(token_ids[:num_tokens])
            counted = num_tokens if count_stop_token else num_tokens - 1
            for check in order:
                if check == "eos" and token_ids[num_tokens - 1] == eos_token_id:
                    return "stop", counted, text
                if check == "stop":
                    if earliest:
                        stop = sorted(stop, key=lambda s: (text.find(s) == -1, text.find(s)))
                    for stop_str in stop:
                        index = text.find(stop_str)
                        if index != -1:
                            return "stop", counted, text[:index] if cut else text
                if check == "length" and num_tokens >= max_tokens:
                    return "length", num_tokens, text
        return None, len(token_ids), tokenizer.decode(token_ids)

    return finish


def gaps_ms(times):
    return [(later - earlier) * 1e3 for earlier, later in zip(times, times[1:], strict=False)]


def concurrency(
    c, usable_bytes, context_len, dtype_bytes, heads=None, rounding=math.floor, clamp=True
):
    """Requests that fit in usable_bytes, with knobs for the heads counted, the rounding and
    the clamp at 0 when the weights do not fit."""
    heads = c.num_key_value_heads if heads is None else heads
    per_request = context_len * 2 * c.num_hidden_layers * heads * c.head_dim * dtype_bytes
    fit = rounding(usable_bytes / per_request)
    return max(0, fit) if clamp else fit


def engine_generate(ns):
    def generate(model, prompt_ids, max_tokens):
        params = ns["SamplingParams"](temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return ns["llm"].generate(prompt_ids, params, use_tqdm=False)[0].outputs[0].token_ids

    return generate


def swapped_timing(ns):
    solution = ns["time_next_token"]
    return lambda token_ids, use_cache: solution(token_ids, not use_cache)


def made_up_after_running(ns):
    """Runs the work, then returns a made-up time that grows the right way."""
    solution = ns["time_next_token"]

    def timing(token_ids, use_cache):
        solution(token_ids, use_cache)
        return 1e-3 if use_cache else 1e-4 * len(token_ids)

    return timing


def prefill_timed(ns):
    """With the cache, times the prefill step and the decode step together."""
    llm, params_type, time = ns["llm"], ns["SamplingParams"], ns["time"]
    solution = ns["time_next_token"]

    def timing(token_ids, use_cache):
        if not use_cache:
            return solution(token_ids, use_cache)
        best = float("inf")
        for _ in range(3):
            params = params_type(temperature=0.0, max_tokens=2, ignore_eos=True)
            start = time.perf_counter()
            llm.engine.add_request("next-token", token_ids, params)
            llm.engine.step()
            llm.engine.step()
            best = min(best, time.perf_counter() - start)
        return best

    return timing


WRONG_ANSWERS = {
    "count_work": {
        "N decode tokens": lambda p, n, b: (p, n, n),
        "one pass too many": lambda p, n, b: (p, n - 1, n + 1),
        "no chunking": lambda p, n, b: (p, n - 1, n),
        "chunks rounded down": lambda p, n, b: (p, n - 1, max(1, p // b) + n - 1),
    },
    "latencies_ms": {
        "seconds": lambda a, t: (t[0] - a, [g / 1e3 for g in gaps_ms(t)]),
        "n gaps": lambda a, t: ((t[0] - a) * 1e3, gaps_ms([a, *t])),
        "ITL from arrival": lambda a, t: ((t[0] - a) * 1e3, [(y - a) * 1e3 for y in t[1:]]),
        "TTFT without arrival": lambda a, t: (t[0] * 1e3, gaps_ms(t)),
    },
    "kv_bytes_held": {
        "last token counted": lambda c, p, n, b: (p + n) * c.kv_bytes_per_token(b),
        "prompt only": lambda c, p, n, b: p * c.kv_bytes_per_token(b),
        "keys only": lambda c, p, n, b: (p + n - 1) * c.kv_bytes_per_token(b) // 2,
        "always bfloat16": lambda c, p, n, b: (p + n - 1) * c.kv_bytes_per_token(2),
    },
    "max_concurrent_requests": {
        "all the memory": lambda c, m, w, L, u=0.9, b=2: concurrency(c, m - w, L, b),
        "no weights": lambda c, m, w, L, u=0.9, b=2: concurrency(c, u * m, L, b),
        "rounded up": lambda c, m, w, L, u=0.9, b=2: concurrency(
            c, u * m - w, L, b, rounding=math.ceil
        ),
        "query heads": lambda c, m, w, L, u=0.9, b=2: concurrency(
            c, u * m - w, L, b, heads=c.num_attention_heads
        ),
        "negative when the weights do not fit": lambda c, m, w, L, u=0.9, b=2: concurrency(
            c, u * m - w, L, b, clamp=False
        ),
    },
    "generate_without_cache": {
        "prompt included": lambda m, ids, n: greedy_loop(m, ids, n, keep_prompt=True),
        "first position": lambda m, ids, n: greedy_loop(m, ids, n, position=0),
        "one token too many": lambda m, ids, n: greedy_loop(m, ids, n + 1),
        "the engine (with its cache)": FromNamespace(engine_generate),
        "autograd left on": lambda m, ids, n: greedy_loop(m, ids, n, inference_mode=False),
    },
    "tokens_computed": {
        "N * P without cache": lambda p, n, c: p + n - 1 if c else n * p,
        "last token computed": lambda p, n, c: p + n if c else sum(range(p, p + n + 1)),
        "cache counts decode only": lambda p, n, c: n - 1 if c else sum(range(p, p + n)),
    },
    "time_next_token": {
        "a constant": lambda ids, c: 1.0,
        "proportional to the length": lambda ids, c: 1e-3 * len(ids),
        "the two swapped": FromNamespace(swapped_timing),
        "made up after running the work": FromNamespace(made_up_after_running),
        "prefill timed too": FromNamespace(prefill_timed),
    },
    "finish_steps": {
        "static batching": static_batches,
        "seat taken in the same step": lambda t, k: seats(t, k, delay=0),
        "seat taken a step late": lambda t, k: seats(t, k, delay=2),
        "every request starts at once": lambda t, k: [n - 1 for n in t],
        "round-robin seats": round_robin_seats,
    },
    "stream_text": {
        "each token alone": decode_each,
        "never holds back": never_hold_back,
        "everything at the end": all_at_the_end,
    },
    "finish": {
        "length before stop strings": finish_with(("eos", "length", "stop")),
        "stop string left in the text": finish_with(("eos", "stop", "length"), cut=False),
        "EOS ignored": finish_with(("stop", "length")),
        "stop token not counted": finish_with(("eos", "stop", "length"), count_stop_token=False),
        "earliest stop string in the text": finish_with(("eos", "stop", "length"), earliest=True),
    },
}


# right answers in other forms the statements allow: each must pass
RIGHT_ANSWERS = {
    "latencies_ms": {
        "a NumPy array of gaps": lambda a, t: ((t[0] - a) * 1e3, np.diff(np.asarray(t)) * 1e3),
        "a tuple of gaps": lambda a, t: ((t[0] - a) * 1e3, tuple(gaps_ms(t))),
    },
}


@pytest.mark.parametrize(
    "name, label", [(n, label) for n, answers in RIGHT_ANSWERS.items() for label in answers]
)
def test_check_accepts_a_right_answer_in_another_form(name, label):
    namespace, checks = exercise_namespace(
        ROOT / "solutions" / "ch01_request_journey.ipynb", RIGHT_ANSWERS
    )
    run_cell(checks[name], wrong_in_place(namespace, name, RIGHT_ANSWERS[name][label]))


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch01_request_journey.ipynb"
    EXERCISE = ROOT / "exercises" / "ch01_request_journey.ipynb"
    POINTS = [2, 3, 2, 2, 3, 2, 2, 3, 3, 3]
    WRONG_ANSWERS = WRONG_ANSWERS
