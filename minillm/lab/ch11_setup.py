"""One streamed request through the whole stack, timed stage by stage (chapter 11).

The server runs in the page's own process (`minillm.serve.run_server`), so the client, the
HTTP handler and the engine thread read one clock, `time.perf_counter`. The engine already
records a request's arrival, first scheduling, every token and its finish (`RequestMetrics`).
`StageRecorder` adds the inside of each engine step: it wraps five methods of one engine
instance (schedule, execute_model, forward, sample, detokenize) for the time of a with-block
and keeps when each call started and ended. Nothing on the serving path changes; the
wrappers are removed when the block ends.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from minillm.core.metrics import RequestMetrics
from minillm.lab.exercise_count import exercise_points  # noqa: F401  (the page's name)

# the methods StageRecorder times, as (stage name, owner attribute of the engine, method)
WRAPPED = (
    ("schedule", "scheduler", "schedule"),
    ("execute", "runner", "execute_model"),
    ("forward", "runner", "forward"),
    ("sample", "runner", "sample"),
    ("detokenize", "output_processor", "detokenize"),
)
# the stages of one engine step, as the figure and the table name them
STEP_PARTS = ("schedule", "prepare inputs", "forward", "logits", "sample", "detokenize", "other")


@dataclass(slots=True)
class StepTiming:
    """What one engine step spent in each part (seconds), from the recorder's intervals."""

    start: float
    end: float
    parts: dict[str, float]


class StageRecorder:
    """Times the parts of every engine step while the with-block runs, and keeps the
    RequestMetrics of every request that finishes."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, float, float]] = []  # (stage, start, end)
        self.finished: dict[str, RequestMetrics] = {}
        self._saved: list[tuple[object, str]] = []

    def _wrap(self, owner: object, method: str, stage: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.calls.append((stage, start, time.perf_counter()))

        setattr(owner, method, timed)  # an instance attribute hides the class's method
        self._saved.append((owner, method))

    def __enter__(self) -> StageRecorder:
        for stage, owner, method in WRAPPED:
            self._wrap(getattr(self.engine, owner), method, stage)
        step = self.engine.step

        def step_and_keep():
            start = time.perf_counter()
            outputs = step()
            self.calls.append(("step", start, time.perf_counter()))
            for output in outputs:
                if output.finished:
                    self.finished[output.request_id] = output.metrics
            return outputs

        self.engine.step = step_and_keep
        self._saved.append((self.engine, "step"))
        return self

    def __exit__(self, *exc) -> None:
        for owner, method in reversed(self._saved):
            delattr(owner, method)  # the class's method shows through again
        self._saved.clear()

    def steps_between(self, start: float, end: float) -> list[StepTiming]:
        """The engine steps that began in [start, end], each split into its parts."""
        return [
            split_step(s, e, self.calls)
            for stage, s, e in self.calls
            if stage == "step" and start <= s <= end
        ]


def split_step(start: float, end: float, calls: Sequence[tuple[str, float, float]]) -> StepTiming:
    """One step's time by part. execute_model holds prepare inputs, forward, logits and
    sample: prepare is execute's start to forward's start, logits forward's end to sample's
    start. "other" is what the step spent outside the timed calls (updating the requests,
    stats, building the outputs)."""
    inside = {stage: (s, e) for stage, s, e in calls if start <= s and e <= end}
    parts = dict.fromkeys(STEP_PARTS, 0.0)
    for stage in ("schedule", "forward", "sample", "detokenize"):
        if stage in inside:
            parts[stage] = inside[stage][1] - inside[stage][0]
    if {"execute", "forward", "sample"} <= inside.keys():
        parts["prepare inputs"] = inside["forward"][0] - inside["execute"][0]
        parts["logits"] = inside["sample"][0] - inside["forward"][1]
    parts["other"] = (end - start) - sum(parts.values())
    return StepTiming(start, end, parts)


@dataclass(slots=True)
class RequestTrace:
    """One streamed request, every time on the perf_counter clock of this process."""

    client_send: float  # just before the client sent the HTTP request
    chunk_times: list[float]  # when each SSE chunk with text reached the client
    client_done: float  # when the client read [DONE]
    metrics: RequestMetrics  # what the engine recorded
    steps: list[StepTiming] = field(default_factory=list)
    text: str = ""

    def stages(self) -> dict[str, float]:
        """The request's time (seconds) in each stage, in order; they add up to the
        client's end-to-end time."""
        m = self.metrics
        prefill_end = m.token_times[0]
        return {
            "HTTP in, parse, tokenize": m.arrival_time - self.client_send,
            "queue": m.first_scheduled_time - m.arrival_time,
            "prefill step": prefill_end - m.first_scheduled_time,
            "first token to client": self.chunk_times[0] - prefill_end,
            "decode steps": m.token_times[-1] - self.chunk_times[0],
            "last token to client": self.client_done - m.token_times[-1],
        }

    @property
    def total_s(self) -> float:
        return self.client_done - self.client_send


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    """The JSON of a streamed, greedy completion of exactly `max_tokens` tokens."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


def stream_completion(
    client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int
) -> tuple:
    """POST a streamed, greedy completion; returns (send time, chunk times, done time, text).

    `client` is made once and kept: making an httpx client loads the TLS certificates,
    which takes longer than the whole local request."""
    body = completion_body(model, prompt, max_tokens)
    chunks: list[float] = []
    text: list[str] = []
    send = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunks.append(time.perf_counter())
            text.append(json.loads(line[6:])["choices"][0]["text"])
    return send, chunks, time.perf_counter(), "".join(text)


def traced_request(
    client: httpx.Client,
    url: str,
    model: str,
    recorder: StageRecorder,
    prompt: str,
    max_tokens: int,
) -> RequestTrace:
    """One streamed request, its engine record and the steps it ran in."""
    before = set(recorder.finished)
    send, chunks, done, text = stream_completion(client, url, model, prompt, max_tokens)
    (request_id,) = set(recorder.finished) - before
    metrics = recorder.finished[request_id]
    trace = RequestTrace(send, chunks, done, metrics, text=text)
    trace.steps = recorder.steps_between(metrics.arrival_time, done)
    return trace


def interleaved(runs: int, kinds: Sequence[str], one: Callable[[str], RequestTrace]) -> dict:
    """`runs` rounds of one request of each kind, in turn ({kind: [trace, ...]}): a slow
    moment of the machine touches every kind alike instead of all runs of one."""
    traces: dict[str, list[RequestTrace]] = {k: [] for k in kinds}
    for _ in range(runs):
        for kind in kinds:
            traces[kind].append(one(kind))
    return traces


def median_and_spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def stage_table(traces: Sequence[RequestTrace]) -> dict[str, tuple[float, float, float]]:
    """Per stage: (median, min, max) over the traces, in seconds."""
    names = list(traces[0].stages())
    return {n: median_and_spread([t.stages()[n] for t in traces]) for n in names}


def step_part_table(traces: Sequence[RequestTrace], decode: bool) -> dict[str, float]:
    """Median time per part of the prefill step (decode=False) or of a decode step (True),
    over every such step of every trace."""
    steps = [s for t in traces for s in (t.steps[1:] if decode else t.steps[:1])]
    return {p: statistics.median(s.parts[p] for s in steps) for p in STEP_PARTS}


def median_trace(traces: Sequence[RequestTrace]) -> RequestTrace:
    """The trace whose end-to-end time is the median (the lower one for an even count)."""
    ordered = sorted(traces, key=lambda t: t.total_s)
    return ordered[(len(ordered) - 1) // 2]


def draw_waterfall(trace: RequestTrace):
    """A waterfall of one request: a row per stage, time from the client's send, and the
    engine steps split into their parts on the rows below."""
    import matplotlib as mpl
    from matplotlib.figure import Figure

    from minillm.lab.figures import PAGE_WIDTH_IN

    t0 = trace.client_send
    stages = trace.stages()
    # a Figure outside pyplot: the page shows the one the cell returns, and only it
    fig = Figure(figsize=(PAGE_WIDTH_IN, 4.2), layout="constrained")
    ax = fig.add_subplot()
    colors = mpl.rcParams["axes.prop_cycle"].by_key()["color"]
    rows = list(stages) + ["engine steps"]
    start = 0.0
    for y, length in enumerate(stages.values()):
        ax.broken_barh([(start * 1e3, max(length, 0.0) * 1e3)], (y - 0.35, 0.7), color="0.55")
        start += length
    y = len(stages)
    for i, part in enumerate(STEP_PARTS):
        spans = []
        for step in trace.steps:
            offset = step.start - t0
            for p in STEP_PARTS[:i]:
                offset += step.parts[p]
            spans.append((offset * 1e3, step.parts[part] * 1e3))
        ax.broken_barh(spans, (y - 0.35, 0.7), color=colors[i % len(colors)], label=part)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("time since the client sent the request (ms)")
    for when in trace.chunk_times:
        ax.axvline((when - t0) * 1e3, color="0.8", lw=0.6, zorder=0)
    ax.legend(ncol=4, fontsize=8, loc="lower right", title="parts of a step", title_fontsize=8)
    return fig
