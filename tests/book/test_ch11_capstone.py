"""The checks of chapter 11's exercises reject plausible wrong answers.

As for the other chapters: the solution's non-graded cells run in this process, then each
graded cell runs with the solution (it must pass), with the stub (NotImplementedError), and
with each wrong answer in the solution's place (it must fail with an AssertionError). The
checks of exercises 3 to 5 run the bundled model, and 4 and 5 a live server in this process;
their wrong answers are slips of the mechanism that a unit test of the function alone could
miss: bans that reach the wrong row or token, a stream read wrongly, bans keyed by text.
"""

from __future__ import annotations

import json

import torch

from minillm.lab import ch11_setup

from .conftest import ROOT
from .exercise_checks import ExerciseChecks, FromNamespace
from .variant_checks import PrivateVariantChecks

# -- exercise 1: ban tokens ---------------------------------------------------------------


def ban(value=float("-inf"), in_place=False, every_row=False, shift=0, as_list=False):
    def ban_tokens(logits, banned):
        out = logits if in_place else logits.clone()
        union = sorted({t for ids in banned for t in ids})
        for row, ids in enumerate(banned):
            ids = union if every_row else ids
            ids = [min(t + shift, logits.shape[1] - 1) for t in ids]
            if ids:
                out[row, ids] = value
        return out.tolist() if as_list else out

    return ban_tokens


# -- exercise 2: the ids of a word ---------------------------------------------------------


def words(min_len=2, strip=True, exact=False, as_set=False):
    def word_token_ids(tokenizer, word):
        ids = []
        for t in range(tokenizer.vocab_size):
            text = tokenizer.decode([t])
            text = text.lstrip() if strip else text
            if exact:
                hit = text == word
            else:
                hit = (
                    bool(text) and word.startswith(text) and (len(text) >= min_len or text == word)
                )
            if hit:
                ids.append(t)
        return set(ids) if as_set else ids

    return word_token_ids


# -- exercise 3: the hook -------------------------------------------------------------------


def hook(kind):
    def factory(ns):
        ban_tokens = ns["ban_tokens"]

        def banning_sample(sample, banned_of):
            calls = []

            def sample_with_bans(logits, rows):
                calls.append(1)
                banned = [list(banned_of(seqs[0])) for seqs in rows]
                if kind == "ignores the bans":
                    return sample(logits, rows)
                if kind == "bans the next id":
                    banned = [[t + 1 for t in ids] for ids in banned]
                if kind == "bans only the first step" and len(calls) > 1:
                    return sample(logits, rows)
                return sample(ban_tokens(logits, banned), rows)

            return sample_with_bans

        return banning_sample

    return FromNamespace(factory)


# -- exercise 4: the SSE client --------------------------------------------------------------


def reader(kind):
    def stream_text(client, url, model, prompt, max_tokens):
        body = ch11_setup.completion_body(model, prompt, max_tokens)
        parts = []
        with client.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    if kind == "keeps [DONE]":
                        parts.append(data)
                    break
                text = json.loads(data)["choices"][0]["text"]
                parts.append(text.strip() if kind == "strips each chunk" else text)
        if kind == "the last chunk":
            return parts[-1]
        if kind == "the first chunk":
            return parts[0]
        text = "".join(parts)
        return text.encode() if kind == "bytes" else text

    return stream_text


# -- exercise 5: bans by prompt ----------------------------------------------------------------


def by_prompt(kind):
    def factory(ns):
        word_token_ids = ns["word_token_ids"]

        def bans_by_prompt(tokenizer, bans):
            if kind == "by text":
                table = {
                    p: [t for w in ws for t in word_token_ids(tokenizer, w)]
                    for p, ws in bans.items()
                }
                return lambda seq: table.get(str(seq.prompt_token_ids), [])
            every = sorted(
                {t for ws in bans.values() for w in ws for t in word_token_ids(tokenizer, w)}
            )
            if kind == "every prompt":
                return lambda seq: every
            first = {
                tuple(tokenizer.encode(p)): word_token_ids(tokenizer, ws[0])
                for p, ws in bans.items()
            }
            return lambda seq: first.get(tuple(seq.prompt_token_ids), [])

        return bans_by_prompt

    return FromNamespace(factory)


# -- exercises 6 and 7: admission --------------------------------------------------------------


def shortest(kind):
    def shortest_first(waiting):
        if kind == "longest first":
            return [r for r, _ in sorted(waiting, key=lambda x: -x[1])]
        if kind == "ties reversed":
            order = sorted(range(len(waiting)), key=lambda i: (waiting[i][1], -i))
            return [waiting[i][0] for i in order]
        if kind == "sorts in place":
            waiting.sort(key=lambda x: x[1])
            return [r for r, _ in waiting]
        return sorted(waiting, key=lambda x: x[1])  # pairs

    return shortest_first


def admission(kind):
    def admit(waiting, token_budget, free_seats, free_blocks, block_size):
        if kind == "arrival order":
            order = [r for r, _ in waiting]
        else:
            order = [r for r, _ in sorted(waiting, key=lambda x: x[1])]
        tokens = dict(waiting)
        out = []
        for rid in order:
            n = tokens[rid]
            blocks = n // block_size if kind == "floor blocks" else -(-n // block_size)
            fits = n <= token_budget if kind != "strict budget" else n < token_budget
            seat = free_seats >= 1 or kind == "no seats"
            if not (fits and seat and blocks <= free_blocks):
                break
            out.append(rid)
            token_budget, free_seats, free_blocks = (
                token_budget - n,
                free_seats - 1,
                free_blocks - blocks,
            )
        return out

    return admit


# -- exercises 8 and 9: stages and the client's TPOT -------------------------------------------


def stages(kind):
    def stage_times(t):
        first, last = t["token_times"][0], t["token_times"][-1]
        got = {
            "http in": t["arrival"] - t["client_send"],
            "queue": t["first_scheduled"] - t["arrival"],
            "prefill": first
            - (t["arrival"] if kind == "prefill from arrival" else t["first_scheduled"]),
            "first back": t["chunk_times"][0] - first,
            "decode": last - t["chunk_times"][0],
            "last back": t["client_done"] - last,
        }
        if kind == "last back from the last chunk":
            got["last back"] = t["client_done"] - t["chunk_times"][-1]
        if kind == "decode from the first token":
            got["decode"] = last - first
        if kind == "reversed":
            got = dict(reversed(got.items()))
        return got

    return stage_times


WRONG_ANSWERS = {
    "ban_tokens": {
        "in place": ban(in_place=True),
        "zero instead of -inf": ban(value=0.0),
        "every row's bans in all rows": ban(every_row=True),
        "the next id": ban(shift=1),
        "a list": ban(as_list=True),
        "hard-coded": lambda logits, banned: torch.tensor(
            [[1.0, 2.0, -float("inf")], [3.0, 2.0, 1.0]]
        ),
    },
    "word_token_ids": {
        "the exact word only": words(exact=True),
        "one-letter pieces too": words(min_len=1),
        "leading space kept": words(strip=False),
        "a set": words(as_set=True),
        "hard-coded": lambda tokenizer, word: [],
    },
    "banning_sample": {
        "ignores the bans": hook("ignores the bans"),
        "bans the next id": hook("bans the next id"),
        "bans only the first step": hook("bans only the first step"),
    },
    "stream_text": {
        "the last chunk": reader("the last chunk"),
        "the first chunk": reader("the first chunk"),
        "keeps [DONE]": reader("keeps [DONE]"),
        "strips each chunk": reader("strips each chunk"),
        "bytes": reader("bytes"),
    },
    "bans_by_prompt": {
        "keyed by the prompt's text": by_prompt("by text"),
        "every prompt's bans for all": by_prompt("every prompt"),
    },
    "shortest_first": {
        "longest first": shortest("longest first"),
        "ties in reverse arrival order": shortest("ties reversed"),
        "sorts `waiting` in place": shortest("sorts in place"),
        "the pairs": shortest("pairs"),
        "hard-coded": lambda waiting: ["b", "c", "a"],
    },
    "admit": {
        "arrival order": admission("arrival order"),
        "blocks rounded down": admission("floor blocks"),
        "a prompt equal to the budget refused": admission("strict budget"),
        "no seat limit": admission("no seats"),
        "hard-coded": lambda *args: ["b", "d"],
    },
    "stage_times": {
        "prefill from arrival": stages("prefill from arrival"),
        "last back from the last chunk": stages("last back from the last chunk"),
        "decode from the first token": stages("decode from the first token"),
        "stages in reverse order": stages("reversed"),
        "hard-coded": lambda t: {
            "http in": 0.5,
            "queue": 0.25,
            "prefill": 1.25,
            "first back": 0.25,
            "decode": 1.75,
            "last back": 1.0,
        },
    },
    "client_tpot": {
        "divides by n": lambda c: (c[-1] - c[0]) / len(c) if len(c) > 1 else None,
        "0 for one chunk": lambda c: (c[-1] - c[0]) / (len(c) - 1) if len(c) > 1 else 0.0,
        "the whole span": lambda c: c[-1] - c[0] if len(c) > 1 else None,
        "sorts in place": lambda c: (
            (c.sort(reverse=True), None)[1]
            if len(c) < 2
            else (c.reverse() or (c[0] - c[-1]) / (len(c) - 1))
        ),
        "hard-coded": lambda c: None if len(c) < 2 else 1.0,
    },
}


class TestChecks(PrivateVariantChecks, ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch11_capstone.ipynb"
    EXERCISE = ROOT / "exercises" / "ch11_capstone.ipynb"
    POINTS = [2, 2, 3, 3, 2, 2, 3, 2, 2]
    WRONG_ANSWERS = WRONG_ANSWERS
    # the functions of data; the others wrap the engine or talk to a server
    COPIED = [
        "ban_tokens",
        "word_token_ids",
        "shortest_first",
        "admit",
        "stage_times",
        "client_tpot",
    ]
