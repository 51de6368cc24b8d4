"""Chapter 7's diagrams: the sampler's pipeline, a speculative round, prompt lookup and a
grammar's token mask, each drawn from the engine's own code or from a real run.

- `traced_sampler_stages` runs the engine's `Sampler` on one row that asks for every
  processor and records the order in which its functions are called;
  `source_sampler_stages` reads the same order from the source of `Sampler.__call__` and
  the methods it calls;
  `draw_sampler_pipeline` draws a list of stages;
- `record_spec_rounds` records every verification of a real speculative run (drafts, how
  many were accepted, the tokens emitted); `draw_spec_round` draws one;
- `draw_ngram_lookup` draws what `ngram_propose` matched and proposed for a token sequence;
- `draw_token_mask` draws which of a few vocabulary tokens a grammar state allows;
- `parse_stack` and `draw_parse_stacks` read a stack out of a context-free grammar's Earley
  chart after a prefix and draw it, one frame per rule the output is inside.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from unittest import mock

import torch

from minillm.lab.diagrams.canvas import Canvas
from minillm.sampling_params import SamplingParams, StructuredOutputsParams
from minillm.spec import spec_runner
from minillm.spec.ngram_proposer import ngram_propose
from minillm.worker import sampler as sampler_module

SMALL = 9

# the sampler's functions and the stage each one is
STAGES = {
    "grammar_masks": "grammar mask",
    "apply_min_tokens": "min_tokens",
    "apply_penalties": "penalties",
    "apply_temperature": "temperature",
    "apply_top_k": "top-k",
    "apply_top_p": "top-p",
    "apply_min_p": "min-p",
    "random_sample": "sample",
}


def traced_sampler_stages() -> list[str]:
    """The stages the engine's `Sampler` runs, in the order it calls them, for one sampled row
    that sets a grammar, min_tokens, a penalty, a temperature and all three filters."""
    calls: list[str] = []

    def recorder(name: str, real: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            calls.append(STAGES[name])
            return real(*args, **kwargs)

        return wrapped

    vocab_size = 8

    def grammar_masks(self, requests, logits):
        calls.append(STAGES["grammar_masks"])
        return torch.ones(len(requests), vocab_size, dtype=torch.bool)

    params = SamplingParams(
        temperature=0.8,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        presence_penalty=0.5,
        min_tokens=1,
        seed=0,
        structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
    )
    state = sampler_module.SamplingState(
        params, [1, 2], [], torch.Generator().manual_seed(0), eos_token_ids=(0,), request_id="r"
    )
    patches = [
        mock.patch.object(sampler_module, name, recorder(name, getattr(sampler_module, name)))
        for name in STAGES
        if name != "grammar_masks"
    ]
    patches.append(mock.patch.object(sampler_module.Sampler, "grammar_masks", grammar_masks))
    for patch in patches:
        patch.start()
    try:
        sampler_module.Sampler()(torch.randn(1, vocab_size), [state])
    finally:
        for patch in patches:
            patch.stop()
    return ["logits", *calls]


def _calls_in_order(function) -> list[str]:
    """Names of the functions and methods a function calls, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name:
                found.append((node.lineno, node.col_offset, name))
    return [name for *_, name in sorted(found)]


def source_sampler_stages() -> list[str]:
    """The stages in the order `Sampler.__call__` names them in its source, read into the
    sampler's own methods where it calls them (`processed_logits`, `draw`)."""
    sampler = sampler_module.Sampler

    def stages_of(function, seen: frozenset[str]) -> list[str]:
        stages = []
        for name in _calls_in_order(function):
            if name in STAGES:
                stages.append(STAGES[name])
            elif name not in seen and inspect.isfunction(getattr(sampler, name, None)):
                stages += stages_of(getattr(sampler, name), seen | {name})
        return stages

    return ["logits", *stages_of(sampler.__call__, frozenset({"__call__"}))]


def draw_sampler_pipeline(stages: Sequence[str]) -> Canvas:
    """The stages as a chain of boxes in two rows; the greedy branch (temperature 0 takes
    the argmax after the penalties) as a side exit."""
    per_row = (len(stages) + 1) // 2
    bw, gap = 2.0, 0.6
    width = per_row * (bw + gap) + 0.4
    c = Canvas(width, 4.6)
    kinds = {
        "logits": "compute",
        "sample": "accent",
        "grammar mask": "host",
        "min_tokens": "host",
        "penalties": "host",
    }
    boxes = []
    for i, stage in enumerate(stages):
        row, col = divmod(i, per_row)
        # the second row runs right to left, so the chain reads as one line
        x = 0.3 + (col if row == 0 else per_row - 1 - col) * (bw + gap)
        y = 3.0 if row == 0 else 0.9
        boxes.append(c.box(x, y, bw, 0.9, stage, kinds.get(stage, "request"), fontsize=SMALL + 1))
    for a, b in zip(boxes, boxes[1:], strict=False):
        sides = ("bottom", "top") if a[1] != b[1] else None
        c.arrow(a, b, sides=sides)
    if "penalties" in stages:
        p = boxes[stages.index("penalties")]
        c.text(p[0] + bw / 2, p[1] - 0.35, "T = 0: argmax here", size=SMALL, color="#C44E52")
    return c


@dataclass(slots=True)
class SpecRound:
    """One verification of one request: the drafts, how many the target accepted, and the
    tokens the round emitted (the accepted drafts, then one corrected or bonus token)."""

    drafts: list[int]
    num_accepted: int
    emitted: list[int]

    @property
    def bonus(self) -> bool:
        """True when every draft was accepted and the extra token is the bonus."""
        return self.num_accepted == len(self.drafts)


def record_spec_rounds(
    llm, prompt: str, params: SamplingParams
) -> tuple[list[SpecRound], list[int]]:
    """Run `llm` (an engine with speculative decoding on) on one prompt and record every round
    of its rejection sampler. Returns the rounds and the output token ids."""
    rounds: list[SpecRound] = []
    real = spec_runner.rejection_sample

    def recording(target_probs, draft_token_ids, num_draft_tokens, *args, **kwargs):
        result = real(target_probs, draft_token_ids, num_draft_tokens, *args, **kwargs)
        for b, k in enumerate(num_draft_tokens):
            rounds.append(
                SpecRound(
                    draft_token_ids[b, :k].tolist(),
                    result.num_accepted[b],
                    list(result.token_ids[b]),
                )
            )
        return result

    with mock.patch.object(spec_runner, "rejection_sample", recording):
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return rounds, list(out.token_ids)


def _show(decode: Callable[[int], str], token_id: int) -> str:
    text = decode(token_id).replace("\n", "⏎").replace(" ", "·")
    return text if len(text) <= 9 else text[:8] + "…"


def draw_spec_round(spec_round: SpecRound, decode: Callable[[int], str]) -> Canvas:
    """One round: the draft's k tokens, the target's one forward over them, and the outcome
    of each position (accepted, rejected and replaced, discarded, or the bonus token)."""
    k = len(spec_round.drafts)
    bw, gap = 1.9, 0.35
    width = 2.6 + (k + 1) * (bw + gap)
    c = Canvas(width, 5.2)
    c.text(0.15, 4.35, "draft\nproposes", ha="left", size=SMALL)
    c.text(0.15, 2.55, "target\nverifies", ha="left", size=SMALL)
    c.text(0.15, 0.75, "emitted", ha="left", size=SMALL)
    x0 = 2.4
    accepted = spec_round.num_accepted
    draft_boxes = []
    for j, token in enumerate(spec_round.drafts):
        draft_boxes.append(
            c.box(
                x0 + j * (bw + gap), 3.95, bw, 0.8, _show(decode, token), "compute", fontsize=SMALL
            )
        )
    c.box(
        x0,
        2.15,
        k * (bw + gap) + bw,
        0.8,
        f"one forward over {k} drafts + 1",
        "request",
        fontsize=SMALL,
    )
    for j in range(k + 1):
        x = x0 + j * (bw + gap)
        if j < accepted:
            c.box(x, 0.35, bw, 0.8, _show(decode, spec_round.emitted[j]), "memory", fontsize=SMALL)
            c.text(x + bw / 2, 1.45, "accepted", size=SMALL, color="#55A868")
        elif j == accepted:
            c.box(
                x,
                0.35,
                bw,
                0.8,
                _show(decode, spec_round.emitted[-1]),
                "accent",
                fontsize=SMALL,
                bold=True,
            )
            c.text(
                x + bw / 2,
                1.45,
                "bonus" if spec_round.bonus else "corrected",
                size=SMALL,
                color="#C44E52",
            )
        else:
            c.box(x, 0.35, bw, 0.8, "", "free", dashed=True)
            unused = "no bonus" if j == k else "discarded"
            c.text(x + bw / 2, 0.75, unused, size=SMALL, color="#6F6F6F")
        if j < k:
            c.arrow(draft_boxes[j], (x + bw / 2, 2.95), sides=("bottom", ""))
    return c


def ngram_match(token_ids: Sequence[int], min_n: int, max_n: int) -> tuple[int, int] | None:
    """(start, n) of the earliest earlier occurrence of the longest suffix n-gram, the one
    `ngram_propose` copies from, or None."""
    tokens = list(token_ids)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for i in range(len(tokens) - n):
            if tokens[i : i + n] == suffix:
                return i, n
    return None


def draw_ngram_lookup(
    token_ids: Sequence[int], min_n: int, max_n: int, k: int, decode: Callable[[int], str]
) -> Canvas:
    """Prompt lookup on a token sequence: its last n tokens, the earlier occurrence of them,
    and the tokens `ngram_propose` proposes (what followed that occurrence)."""
    tokens = list(token_ids)
    proposal = ngram_propose(tokens, min_n, max_n, k)
    found = ngram_match(tokens, min_n, max_n)
    n = found[1] if found else min_n
    bw = 1.15
    width = 3.2 + (n + max(len(proposal), 1)) * bw + 0.4
    c = Canvas(width, 4.2)
    x0 = 3.2
    c.text(x0 - 0.2, 3.0, "earlier in\nthe sequence", ha="right", size=SMALL)
    c.text(x0 - 0.2, 1.0, "last tokens", ha="right", size=SMALL)
    if found:
        start = found[0]
        c.text(x0 - 0.2, 3.85, f"position {start}", ha="right", size=SMALL, color="#6F6F6F")
        for j, token in enumerate(tokens[start : start + n]):
            c.box(
                x0 + j * bw,
                2.6,
                bw - 0.08,
                0.8,
                _show(decode, token),
                "host",
                rounded=False,
                fontsize=SMALL,
            )
        for j, token in enumerate(tokens[start + n : start + n + len(proposal)]):
            c.box(
                x0 + (n + j) * bw,
                2.6,
                bw - 0.08,
                0.8,
                _show(decode, token),
                "memory",
                rounded=False,
                fontsize=SMALL,
            )
    for j, token in enumerate(tokens[len(tokens) - n :]):
        c.box(
            x0 + j * bw,
            0.6,
            bw - 0.08,
            0.8,
            _show(decode, token),
            "accent",
            rounded=False,
            fontsize=SMALL,
        )
    for j, token in enumerate(proposal):
        c.box(
            x0 + (n + j) * bw,
            0.6,
            bw - 0.08,
            0.8,
            _show(decode, token),
            "memory",
            dashed=True,
            fill=0.8,
            fontsize=SMALL,
        )
    if proposal:
        mid = x0 + (n + len(proposal) / 2) * bw
        c.arrow((mid, 2.55), (mid, 1.45), "proposed drafts", label_offset=(1.6, 0.0), kind="memory")
    c.arrow(
        (x0 + n * bw / 2, 1.45),
        (x0 + n * bw / 2, 2.55),
        f"same {n}-gram",
        label_offset=(-1.3, 0.0),
        kind="accent",
    )
    return c


def draw_token_mask(
    grammar, state: int, token_ids: Sequence[int], decode: Callable[[int], str]
) -> Canvas:
    """A few vocabulary tokens and whether `grammar` (a `TokenGrammar`) allows each in
    `state`: allowed ones keep their logit, masked ones get -inf."""
    mask = grammar.token_mask(state)
    per_row = 6
    bw = 1.6
    rows = (len(token_ids) + per_row - 1) // per_row
    width = per_row * (bw + 0.2) + 0.4
    c = Canvas(width, rows * 1.3 + 0.7)
    for j, token in enumerate(token_ids):
        row, col = divmod(j, per_row)
        allowed = bool(mask[token])
        label = f"{_show(decode, token)} → {'keep' if allowed else '-inf'}"
        c.box(
            0.3 + col * (bw + 0.2),
            c.height - 1.5 - row * 1.3,
            bw,
            0.9,
            label,
            "memory" if allowed else "free",
            fontsize=SMALL,
            dashed=not allowed,
        )
    c.text(
        width / 2,
        c.height - 0.3,
        f"state {state}: {int(mask.sum())} of {len(mask)} tokens allowed",
        size=SMALL,
    )
    return c


def parse_stack(grammar, prefix: bytes, deepest: bool = False) -> list[str]:
    """The rules `grammar` (a `ContextFreeGrammar`) is inside after `prefix`, top first: one of
    the stacks its Earley chart holds (the first found, or the deepest), each frame an item
    `rule → matched • rest`."""
    chart = [grammar.initial_set()]
    for byte in prefix:
        nxt = grammar.scan(chart, byte)
        if nxt is None:
            raise ValueError(f"{prefix!r} is not a prefix of the grammar's language")
        chart.append(nxt)
    stacks = grammar.parse_stacks(chart, limit=16)
    stack = max(stacks, key=len) if deepest else stacks[0]
    return [grammar.item_label(item) for item in stack]


def draw_parse_stacks(panels: Sequence[tuple[str, Sequence[str]]]) -> Canvas:
    """Stacks drawn top frame first, one panel per (title, frames), panels one under another;
    the top frame (the terminal being read) is highlighted, the start rule at the bottom."""
    row, gap, width = 0.62, 0.12, 14.0
    height = sum(0.8 + len(frames) * (row + gap) for _, frames in panels) + 0.2
    c = Canvas(width, height)
    y = height - 0.2
    for title, frames in panels:
        c.text(0.3, y - 0.3, title, size=SMALL, ha="left", fontweight="bold")
        y -= 0.8
        for depth, frame in enumerate(frames):
            y -= row + gap
            c.box(
                1.4,
                y,
                width - 1.7,
                row,
                frame,
                "compute" if depth == 0 else "memory",
                fontsize=SMALL - 0.5,
                fill=0.55 if depth == 0 else 0.8,
            )
            tag = "top" if depth == 0 else ("bottom" if depth == len(frames) - 1 else "")
            if tag:
                c.text(0.75, y + row / 2, tag, size=SMALL - 1)
    return c


def draw_drafter_kinds() -> Canvas:
    """Where the drafter sits: a separate draft model, Medusa heads, an EAGLE head and an MTP
    block, each beside the target's layers (a concept picture, not engine state)."""
    c = Canvas(13.0, 10.6)
    panels = [
        ("draft model", 0.2, 5.5),
        ("Medusa", 6.8, 5.5),
        ("EAGLE", 0.2, 0.2),
        ("MTP", 6.8, 0.2),
    ]
    for title, x, y in panels:
        c.text(x + 3.0, y + 4.6, title, fontweight="bold")
        target = c.box(x + 0.2, y + 0.3, 2.4, 3.6, "target\nlayers", "request")
        if title == "draft model":
            small = c.box(
                x + 3.6, y + 1.0, 2.2, 2.2, "small model\n+ own KV", "compute", fontsize=SMALL
            )
            c.text(x + 4.7, y + 3.7, "k steps of its own", size=SMALL)
            c.arrow(small, target, sides=("left", "right"))
        elif title == "Medusa":
            for j in range(3):
                head = c.box(
                    x + 3.6,
                    y + 0.3 + 1.25 * j,
                    2.2,
                    0.95,
                    f"head {j + 1}: +{j + 1}",
                    "compute",
                    fontsize=SMALL,
                )
                c.arrow((x + 2.6, y + 3.2), head, sides=("", "left"))
            c.text(x + 4.7, y + 4.1, "k tokens at once", size=SMALL)
        elif title == "EAGLE":
            head = c.box(x + 3.6, y + 1.4, 2.2, 1.4, "1-layer\nhead", "compute", fontsize=SMALL)
            c.arrow((x + 2.6, y + 2.1), head, sides=("", "left"))
            c.text(x + 4.7, y + 3.4, "features → next\nfeature, k steps", size=SMALL)
        else:
            head = c.box(x + 3.6, y + 1.4, 2.2, 1.4, "MTP\nblock", "compute", fontsize=SMALL)
            c.arrow((x + 2.6, y + 2.1), head, sides=("", "left"))
            c.text(x + 4.7, y + 3.4, "trained with\nthe model", size=SMALL)
    return c


__all__ = [
    "STAGES",
    "SpecRound",
    "draw_drafter_kinds",
    "draw_ngram_lookup",
    "draw_sampler_pipeline",
    "draw_spec_round",
    "draw_token_mask",
    "ngram_match",
    "record_spec_rounds",
    "source_sampler_stages",
    "traced_sampler_stages",
]
