"""Diagrams of the preface and chapters 1 and 2: what the book builds, a request's journey
through the engine, what the KV cache saves, one engine step, and what a decode step moves.

Each function returns a `Canvas`. Where the picture is engine state (a request's output, the
scheduler's trace of a step, a step's FLOPs and bytes) it is drawn from that object, so the
numbers on the picture are the engine's.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.core.metrics import StepTrace
from minillm.lab.diagrams.canvas import Canvas
from minillm.lab.figures import FONT_SIZE, PALETTE
from minillm.lab.hardware import DeviceSpec
from minillm.lab.roofline import StepCost, bandwidth_floor_s, compute_floor_s
from minillm.outputs import RequestOutput

MONO = "DejaVu Sans Mono"


class StageCanvas(Canvas):
    """A `Canvas` whose boxes hold a title, a line of code and a note, each in its own font.

    `labels()` reads back the three lines joined by newlines, as one label per box.
    """

    def stage(
        self,
        x: float,
        y: float,
        w: float,
        h: float,
        title: str,
        code: str = "",
        note: str = "",
        kind: str = "free",
        *,
        fill: float = 0.75,
    ) -> tuple[float, float, float, float]:
        box = self.box(x, y, w, h, kind=kind, fill=fill)
        lines = [(title, {"fontweight": "bold", "size": FONT_SIZE})]
        if code:
            lines.append((code, {"family": MONO, "size": FONT_SIZE - 1}))
        for line in note.splitlines():
            lines.append((line, {"size": FONT_SIZE - 1, "color": PALETTE["muted"]}))
        step = min(0.62, h / (len(lines) + 0.6))
        top = y + h / 2 + step * (len(lines) - 1) / 2
        for i, (text, style) in enumerate(lines):
            self.text(x + w / 2, top - i * step, text, **style)
        self.boxes[-1] = (*box, "\n".join(text for text, _ in lines))
        return box


# ---------------------------------------------------------------------------------------------
# Chapter 1: the journey at a glance


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of a request's journey and the minillm code that does it."""

    name: str
    does: str
    code: tuple[str, ...]  # "module:qualified.name" of each function or class that does it
    chapters: tuple[int, ...]  # the chapters that treat it

    @property
    def names(self) -> list[str]:
        """The code's qualified names, as the page shows them (`Tokenizer.encode`)."""
        return [ref.split(":")[1] for ref in self.code]

    @property
    def files(self) -> list[str]:
        """The source files of the code, relative to the package (`model/tokenizer.py`)."""
        return [
            ref.split(":")[0].removeprefix("minillm.").replace(".", "/") + ".py"
            for ref in self.code
        ]


JOURNEY = (
    Stage(
        "tokenization",
        "text becomes a list of token ids",
        ("minillm.model.tokenizer:Tokenizer.encode",),
        (1,),
    ),
    Stage(
        "scheduling",
        "the request waits, then runs; each step's plan says how many of its tokens to compute",
        ("minillm.core.scheduler:Scheduler.schedule",),
        (1, 4),
    ),
    Stage(
        "prefill",
        "one forward pass over every prompt token; their keys and values go into the KV cache",
        ("minillm.worker.model_runner:ModelRunner.execute_model",),
        (1, 2, 4),
    ),
    Stage(
        "decode",
        "one forward pass per new token, reading the cache and appending to it",
        ("minillm.worker.model_runner:ModelRunner.execute_model",),
        (1, 2, 5),
    ),
    Stage(
        "sampling",
        "the logits of the last position become one token id",
        ("minillm.worker.sampler:Sampler.__call__",),
        (1, 7),
    ),
    Stage(
        "detokenization",
        "the new token id becomes new text, a whole character at a time",
        ("minillm.model.tokenizer:IncrementalDetokenizer.add_token",),
        (1, 7),
    ),
    Stage(
        "stop checks",
        "EOS, a stop token, a stop string or a length limit ends the request",
        (
            "minillm.core.scheduler:check_stop",
            "minillm.engine.output_processor:detokenize_new_tokens",
        ),
        (1,),
    ),
)


def resolve(ref: str) -> object:
    """The object `module:qualified.name` names, imported (an error if it does not exist)."""
    module_name, _, qualname = ref.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _stage(name: str) -> Stage:
    return next(s for s in JOURNEY if s.name == name)


def _short(text: str, limit: int = 30) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def draw_request_journey(output: RequestOutput, kv_bytes_per_token: int) -> StageCanvas:
    """A request's path through the engine, each stage with the minillm code that does it,
    labelled with the request's own counts: prompt tokens, decode steps, KV-cache tokens
    and bytes (`kv_bytes_per_token` of the model and format), and its finish reason."""
    completion = output.outputs[0]
    num_prompt, num_output = len(output.prompt_token_ids), len(completion.token_ids)
    num_cached = num_prompt + num_output - 1  # the last token is never fed back
    c = StageCanvas(24, 14.6)
    w, h, left, right = 9.4, 2.3, 0.3, 14.3
    rows = [11.9, 8.95, 6.0, 3.05]
    text_in = c.stage(left, rows[0], w, h, "text in", _short(output.prompt or ""), "", "request")
    tok = c.stage(
        left,
        rows[1],
        w,
        h,
        "tokenization",
        _stage("tokenization").names[0],
        f"{num_prompt} token ids",
        "host",
    )
    sched = c.stage(
        left,
        rows[2],
        w,
        h,
        "scheduling",
        _stage("scheduling").names[0],
        "waiting \u2192 running",
        "host",
    )
    runner = c.stage(
        left,
        rows[3],
        w,
        h,
        "forward pass",
        _stage("prefill").names[0],
        f"prefill {num_prompt} tokens, then {num_output - 1} \u00d7 decode 1",
        "compute",
    )
    c.stage(
        left,
        0.1,
        w,
        2.0,
        "KV cache",
        note=f"{num_cached} tokens \u00d7 {kv_bytes_per_token:,} bytes = "
        f"{num_cached * kv_bytes_per_token:,} bytes",
        kind="memory",
    )
    sampler = c.stage(
        right,
        rows[3],
        w,
        h,
        "sampling",
        _stage("sampling").names[0],
        "logits \u2192 1 token id",
        "compute",
    )
    detok = c.stage(
        right,
        rows[2],
        w,
        h,
        "detokenization",
        _stage("detokenization").names[0],
        "token id \u2192 text",
        "host",
    )
    stop = c.stage(
        right,
        rows[1],
        w,
        h,
        "stop checks",
        " \u00b7 ".join(_stage("stop checks").names),
        "EOS, stop string, max_tokens",
        "host",
    )
    out = c.stage(
        right,
        rows[0],
        w,
        h,
        "text out",
        f'finish_reason="{completion.finish_reason}"',
        f"{num_output} tokens",
        "request",
    )
    for a, b in [(text_in, tok), (tok, sched), (sched, runner)]:
        c.arrow(a, b)
    for a, b in [(sampler, detok), (detok, stop), (stop, out)]:
        c.arrow(a, b)
    c.arrow(runner, sampler, "logits", label_offset=(0, 0.3))
    c.arrow(
        (left + w * 0.3, rows[3]),
        (left + w * 0.3, 2.1),
        "write K, V",
        kind="memory",
        label_offset=(-1.3, 0),
    )
    c.arrow(
        (left + w * 0.7, 2.1),
        (left + w * 0.7, rows[3]),
        "read all",
        kind="memory",
        label_offset=(1.1, 0),
    )
    # the decode loop: a request that is not finished goes back to the scheduler
    c.arrow((right, rows[1] + h / 2), (left + w, rows[2] + h / 2), kind="accent", curve=-0.25)
    c.text(12.0, rows[2] + 0.75, "not finished:", size=FONT_SIZE - 1, color=PALETTE["accent"])
    c.text(12.0, rows[2] + 0.2, "next step", size=FONT_SIZE - 1, color=PALETTE["accent"])
    return c


def request_steps(traces: Sequence[StepTrace], request_id: str) -> list[int]:
    """The tokens the request computed in each step it ran, from the scheduler's trace."""
    return [n for trace in traces for rid, n, _ in trace.scheduled if rid == request_id]


def draw_kv_cache_reuse(steps: Sequence[int], tokens: Sequence[str]) -> Canvas:
    """Which positions each forward pass computes, without a KV cache and with one.

    `steps` are the tokens the request computed in each of its steps (`request_steps`: the
    prompt, then 1 per decode step); `tokens` the text of every position the passes see.
    Without a cache a pass recomputes every position so far; with one it computes the new
    positions and reads the others from the cache. Each row ends in a box with its count.
    """
    num_positions = sum(steps)
    if len(tokens) != num_positions:
        raise ValueError(f"{len(tokens)} token texts for {num_positions} positions")
    label_w, cell, count_w, gap = 3.2, 1.0, 3.0, 1.2
    rows = len(steps)
    width = label_w + num_positions * cell + count_w + 0.4
    panel_h = rows * cell
    height = 2 * panel_h + 3 * gap + 3.4
    c = Canvas(width, height)
    # column headers: the token of each position, shared by both panels
    top = height - 2.0
    for p, text in enumerate(tokens):
        c.text(
            label_w + (p + 0.5) * cell,
            top + 0.15,
            text,
            size=FONT_SIZE - 2,
            family=MONO,
            rotation=55,
            ha="left",
            va="bottom",
            rotation_mode="anchor",
        )
    for panel, cached in enumerate((False, True)):
        y0 = top - gap - panel * (panel_h + gap + 0.6) - 0.2
        c.text(
            0.1,
            y0 + 0.45,
            "with a KV cache" if cached else "without a KV cache",
            ha="left",
            fontweight="bold",
        )
        done, total = 0, 0
        for r, n in enumerate(steps):
            y = y0 - (r + 1) * cell
            c.text(label_w - 0.2, y + cell / 2, f"step {r}", ha="right", size=FONT_SIZE - 1)
            for p in range(done + n):
                if p >= done:
                    kind, fill = "compute", 0.25
                elif cached:
                    kind, fill = "memory", 0.55
                else:
                    kind, fill = "compute", 0.25
                c.box(
                    label_w + p * cell + 0.04,
                    y + 0.04,
                    cell - 0.08,
                    cell - 0.08,
                    kind=kind,
                    fill=fill,
                    rounded=False,
                )
            computed = n if cached else done + n
            total += computed
            c.box(
                label_w + num_positions * cell + 0.3,
                y + 0.06,
                count_w - 0.2,
                cell - 0.12,
                str(computed),
                kind="free",
                fill=0.6,
                fontsize=FONT_SIZE - 1,
            )
            done += n
        c.text(
            label_w + num_positions * cell + 0.2 + count_w / 2,
            y0 + 0.45,
            f"{total:,} computed",
            fontweight="bold",
            size=FONT_SIZE - 1,
        )
    legend_y = 0.35
    c.box(label_w, legend_y, 0.8, 0.8, kind="compute", fill=0.25, rounded=False)
    c.text(label_w + 1.1, legend_y + 0.4, "computed in the pass", ha="left", size=FONT_SIZE - 1)
    c.box(label_w + 9.5, legend_y, 0.8, 0.8, kind="memory", fill=0.55, rounded=False)
    c.text(label_w + 10.6, legend_y + 0.4, "read from the KV cache", ha="left", size=FONT_SIZE - 1)
    return c


def draw_engine_step(trace: StepTrace) -> StageCanvas:
    """One engine step as a loop, labelled with a real step of the scheduler's trace: the
    plan (each request's tokens and phase), the forward pass over all of them, the update
    that appends the sampled tokens, and the output processor."""
    plan = ", ".join(
        f"{rid}: {'P' if phase == 'prefill' else 'D'}{n}" for rid, n, phase in trace.scheduled
    )
    num_tokens = sum(n for _, n, _ in trace.scheduled)
    num_sampled = len(trace.scheduled)
    c = StageCanvas(24, 9.6)
    w, h = 9.0, 2.6
    schedule = c.stage(
        0.3,
        6.7,
        w,
        h,
        "1. plan",
        "Scheduler.schedule",
        f"{plan}; {trace.num_waiting} waiting",
        "host",
    )
    execute = c.stage(
        14.7,
        6.7,
        w,
        h,
        "2. forward pass",
        "ModelRunner.execute_model",
        f"{num_tokens} " + ("token" if num_tokens == 1 else "tokens") + " in one batch",
        "compute",
    )
    update = c.stage(
        14.7,
        0.3,
        w,
        h,
        "3. update",
        "Scheduler.update_from_output",
        "append tokens, check_stop",
        "host",
    )
    detok = c.stage(
        0.3, 0.3, w, h, "4. text", "OutputProcessor.detokenize", "new text, stop strings", "host"
    )
    c.arrow(schedule, execute, "plan")
    c.arrow(
        execute,
        update,
        f"{num_sampled} sampled " + ("token" if num_sampled == 1 else "tokens"),
        label_offset=(2.4, 0),
    )
    c.arrow(update, detok, "progressed requests", label_offset=(0, 0.45))
    c.arrow(detok, schedule, "next step", kind="accent", label_offset=(1.3, 0))
    c.text(12.0, 4.8, f"LLMEngine.step, step {trace.step}", family=MONO, fontweight="bold")
    return c


def draw_schedule(runs: Sequence[tuple[str, Sequence[StepTrace], Sequence[str]]]) -> Canvas:
    """Schedules from the scheduler's trace, one panel per run: a row per request, a column
    per engine step; a prefill cell (orange) holds the tokens it computed, a decode cell
    (blue) computed one. `runs` are (title, traces, request ids) triples."""
    num_steps = max(len(traces) for _, traces, _ in runs)
    label_w = 1.6
    width = max(label_w + num_steps + 0.3, 17.0)  # room for the legend
    heights = [len(ids) + 1.6 for _, _, ids in runs]
    height = sum(heights) + 1.2
    c = Canvas(width, height, inches=min(7.8, width * 0.42))
    top = height
    for title, traces, request_ids in runs:
        top -= 1.0
        c.text(0.05, top + 0.3, title, ha="left", fontweight="bold", size=FONT_SIZE - 1)
        row_of = {rid: i for i, rid in enumerate(request_ids)}
        for rid, i in row_of.items():
            c.text(label_w - 0.3, top - i - 0.5, rid, ha="right", size=FONT_SIZE - 1)
        first = traces[0].step
        for trace in traces:
            x = label_w + trace.step - first
            for rid, n, phase in trace.scheduled:
                y = top - row_of[rid] - 1
                prefill = phase == "prefill"
                c.box(
                    x + 0.04,
                    y + 0.06,
                    0.92,
                    0.88,
                    str(n) if prefill else "",
                    kind="compute" if prefill else "request",
                    fill=0.35 if prefill else 0.5,
                    rounded=False,
                    fontsize=FONT_SIZE - 2,
                )
        for k in range(0, len(traces), 5):
            c.text(
                label_w + k + 0.5,
                top - len(request_ids) - 0.3,
                str(k),
                size=FONT_SIZE - 2,
                color=PALETTE["muted"],
            )
        top -= len(request_ids) + 0.6
    c.box(label_w, 0.15, 0.8, 0.8, kind="compute", fill=0.35, rounded=False)
    c.text(label_w + 1.1, 0.55, "prefill (tokens computed)", ha="left", size=FONT_SIZE - 1)
    c.box(label_w + 8.8, 0.15, 0.8, 0.8, kind="request", fill=0.5, rounded=False)
    c.text(label_w + 9.9, 0.55, "decode (1 token)", ha="left", size=FONT_SIZE - 1)
    return c


# ---------------------------------------------------------------------------------------------
# Chapter 2: what one decode step moves and computes


def _bytes_text(num_bytes: float) -> str:
    if num_bytes >= 1e9:
        return f"{num_bytes / 1e9:.2f} GB"
    if num_bytes >= 1e6:
        return f"{num_bytes / 1e6:.1f} MB"
    return f"{num_bytes / 1e3:.1f} kB"


def draw_step_traffic(
    cost: StepCost, device: DeviceSpec, peak_flops_per_s: float, title: str
) -> StageCanvas:
    """What one step moves from memory and computes, and the time each takes at `device`'s
    bandwidth and `peak_flops_per_s`: the larger of the two is the step's floor."""
    bw = device.memory_bandwidth_bytes_per_s
    t_mem = bandwidth_floor_s(cost.min_bytes, bw)
    t_compute = compute_floor_s(cost.flops, peak_flops_per_s)
    c = StageCanvas(24, 11.0)
    c.box(0.3, 0.3, 9.4, 9.2, kind="memory", fill=0.88)
    c.text(5.0, 9.0, f"HBM ({device.memory_bytes / 2**30:.0f} GiB)", fontweight="bold")
    weights = c.stage(
        0.8,
        5.6,
        8.4,
        2.8,
        "weights",
        note=f"{_bytes_text(cost.weight_bytes)}, read once",
        kind="memory",
        fill=0.45,
    )
    kv = c.stage(
        0.8,
        3.0,
        8.4,
        2.2,
        "KV cache",
        note=f"{_bytes_text(cost.kv_bytes)}, read once",
        kind="memory",
        fill=0.6,
    )
    c.stage(
        0.8,
        0.8,
        8.4,
        1.8,
        "activations",
        note=f"{_bytes_text(cost.activation_bytes)}, mostly on chip",
        kind="free",
        fill=0.5,
    )
    chip = c.stage(
        14.3,
        4.2,
        9.4,
        3.6,
        f"{device.num_compute_units} {device.compute_unit}s",
        "tensor cores",
        f"{cost.flops / 1e9:,.1f} GFLOP",
        "compute",
    )
    for box in (weights, kv):
        c.arrow(box, chip, kind="memory")
    for i, line in enumerate((_bytes_text(cost.min_bytes), f"at {bw / 1e12:.2f} TB/s")):
        c.text(12.0, 9.3 - 0.55 * i, line, size=FONT_SIZE - 1)
    c.text(12.0, 8.2, f"= {t_mem * 1e3:.2f} ms", size=FONT_SIZE - 1, fontweight="bold")
    bound = "memory" if t_mem >= t_compute else "compute"
    c.stage(
        14.3,
        0.4,
        9.4,
        3.0,
        f"floor {max(t_mem, t_compute) * 1e3:.2f} ms: {bound}-bound",
        note=f"compute {t_compute * 1e3:.3f} ms at {peak_flops_per_s / 1e12:.0f} TFLOP/s",
        kind="accent",
        fill=0.85,
    )
    c.text(12.0, 10.5, title, fontweight="bold")
    return c


# ---------------------------------------------------------------------------------------------
# The preface: what the book builds

# each package of minillm (and the Triton kernels beside it), what it holds, and the
# chapters that open it, in the order a request meets them
PACKAGES = (
    ("minillm.serve", "OpenAI-compatible server, router", (9, 10)),
    ("minillm.engine", "LLMEngine.step, output processor", (1,)),
    ("minillm.core", "scheduler, block pool, prefix cache", (3, 4)),
    ("minillm.spec", "speculative decoding", (7,)),
    ("minillm.structured", "grammars, JSON schemas", (7,)),
    ("minillm.worker", "model runner, sampler, CUDA graphs", (1, 5, 7)),
    ("minillm.distributed", "tensor, pipeline, expert parallel", (8,)),
    ("minillm.model", "Llama, attention, tokenizer, quantization", (1, 6)),
    ("kernels", "Triton kernels", (5,)),
    ("minillm.lora", "LoRA adapters", (10,)),
    ("minillm.lab", "roofline, measurements, simulators", (2,)),
    ("minillm.course", "glue, exercises, grading", (0,)),
)


def _chapters_text(chapters: Sequence[int]) -> str:
    if chapters == (0,):
        return "preface"
    return ("chapter " if len(chapters) == 1 else "chapters ") + ", ".join(map(str, chapters))


def draw_book_map() -> StageCanvas:
    """The packages of minillm as layers a request passes through, top to bottom, each with
    what it holds and the chapters that open it; the lab and the course serve every chapter."""
    c = StageCanvas(24, 15.4)
    h, full, half = 2.2, 23.4, 11.6
    layout = {  # name: (x, y, width)
        "minillm.serve": (0.3, 12.9, full),
        "minillm.engine": (0.3, 10.5, full),
        "minillm.core": (0.3, 8.1, 9.2),
        "minillm.spec": (9.7, 8.1, 6.9),
        "minillm.structured": (16.8, 8.1, 6.9),
        "minillm.worker": (0.3, 5.7, half),
        "minillm.distributed": (12.1, 5.7, half),
        "minillm.model": (0.3, 3.3, half),
        "kernels": (12.1, 3.3, 5.7),
        "minillm.lora": (18.0, 3.3, 5.7),
        "minillm.lab": (0.3, 0.1, half),
        "minillm.course": (12.1, 0.1, half),
    }
    kinds = {
        "minillm.serve": "request",
        "minillm.engine": "host",
        "minillm.core": "host",
        "minillm.lab": "accent",
        "minillm.course": "free",
        "minillm.lora": "memory",
        "minillm.spec": "host",
        "minillm.structured": "host",
    }
    for name, what, chapters in PACKAGES:
        x, y, w = layout[name]
        c.stage(
            x,
            y,
            w,
            h,
            name,
            note=f"{what}\n{_chapters_text(chapters)}",
            kind=kinds.get(name, "compute"),
        )
    c.ax.plot([0.3, 23.7], [2.75, 2.75], color=PALETTE["muted"], linestyle=":", linewidth=1)
    return c


__all__ = [
    "JOURNEY",
    "PACKAGES",
    "Stage",
    "StageCanvas",
    "draw_book_map",
    "draw_engine_step",
    "draw_kv_cache_reuse",
    "draw_request_journey",
    "draw_schedule",
    "draw_step_traffic",
    "request_steps",
    "resolve",
]
