"""Chapters 9 and 10's diagrams: a request's timeline, SLOs, load loops, and a fleet.

The pictures of engine state are drawn from the real objects: a request's timeline from
its `RequestMetrics`, which requests meet an SLO from `serving_metrics.meets_slo`, a
router's choices from `minillm.serve.router.Router.choose`, a token bucket's level and
its 429s from `minillm.serve.rate_limit.TokenBucket`, a cold start's phases from
`minillm.lab.cold_start.ColdStart`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import NullFormatter

from minillm.core.metrics import RequestMetrics
from minillm.lab import serving_metrics as sm
from minillm.lab.diagrams.canvas import Canvas, color
from minillm.lab.figures import PAGE_WIDTH_IN, PALETTE
from minillm.serve.rate_limit import EPSILON, TokenBucket
from minillm.serve.router import Router

# ---------------------------------------------------------------- one request's timeline


def draw_request_timeline(metrics: RequestMetrics, max_tokens_drawn: int = 40) -> Canvas:
    """One request on a time axis from its engine timestamps: queueing (arrival to first
    scheduled), prefill to the first token (TTFT), each token, the gaps between them (ITL),
    and the end (E2EL). Times in ms since arrival; the boxes' labels carry the values."""
    if metrics.finished_time is None or not metrics.token_times:
        raise ValueError("draw_request_timeline needs a finished request with tokens")
    t0 = metrics.arrival_time
    end_ms = (metrics.finished_time - t0) * 1e3
    tokens_ms = [(t - t0) * 1e3 for t in metrics.token_times][:max_tokens_drawn]
    sched_ms = ((metrics.first_scheduled_time or t0) - t0) * 1e3
    width = 30.0
    scale = (width - 2.0) / max(end_ms, 1e-9)  # units per ms

    def x(ms: float) -> float:
        return 1.0 + ms * scale

    c = Canvas(width, 7.4)
    queue_ms = metrics.queueing_time_s * 1e3 if metrics.queueing_time_s is not None else 0.0
    ttft_ms = metrics.ttft_s * 1e3
    if queue_ms > 0:
        c.box(x(0), 3.6, max(x(sched_ms) - x(0), 0.05), 1.2, "", "free", rounded=False)
    c.box(
        x(sched_ms),
        3.6,
        max(x(tokens_ms[0]) - x(sched_ms), 0.05),
        1.2,
        "",
        "compute",
        rounded=False,
    )
    for i, t in enumerate(tokens_ms):
        c.box(x(t) - 0.09, 3.4, 0.18, 1.6, "", "request", fill=0.0, rounded=False)
        if i:
            c.box(
                x(tokens_ms[i - 1]),
                3.95,
                x(t) - x(tokens_ms[i - 1]),
                0.5,
                "",
                "memory",
                fill=0.7,
                rounded=False,
            )
    c.ax.axvline(x(end_ms), ymin=0.3, ymax=0.75, color=PALETTE["ink"], lw=1, ls=":")
    # the labels the picture carries, read back by canvas.labels()
    mid_ttft = (x(0) + x(ttft_ms)) / 2
    c.arrow((x(0), 5.3), (x(ttft_ms), 5.3), both=True)
    c.text(mid_ttft, 6.0 if queue_ms <= 0 else 6.9, f"TTFT {ttft_ms:.1f} ms", size=10)
    gaps = sm.itl_s(metrics.token_times)
    if gaps:
        widest = max(range(len(gaps)), key=gaps.__getitem__) + 1
        if widest < len(tokens_ms):
            a, b = x(tokens_ms[widest - 1]), x(tokens_ms[widest])
            c.arrow((a, 5.3), (b, 5.3), both=True, kind="accent")
            c.text(
                (a + b) / 2,
                6.0,
                f"widest ITL gap {gaps[widest - 1] * 1e3:.1f} ms",
                size=10,
                color=PALETTE["accent"],
            )
    c.arrow((x(0), 2.6), (x(end_ms), 2.6), both=True)
    n = metrics.num_output_tokens
    tpot = metrics.tpot_s
    tpot_text = f", TPOT {tpot * 1e3:.1f} ms" if tpot is not None else ""
    c.text((x(0) + x(end_ms)) / 2, 1.7, f"E2EL {end_ms:.1f} ms for {n} tokens{tpot_text}", size=10)
    prefill_ms = tokens_ms[0] - sched_ms
    c.text(
        x(0),
        0.2,
        f"grey: queued {queue_ms:.1f} ms    orange: prefill {prefill_ms:.1f} ms    "
        "blue: a token    green: the gaps (ITL)",
        ha="left",
        size=9,
        color=PALETTE["muted"],
    )
    c.timeline = {
        "queue_ms": queue_ms,
        "ttft_ms": ttft_ms,
        "e2el_ms": end_ms,
        "num_tokens": n,
        "prefill_ms": prefill_ms,
    }
    return c


# ---------------------------------------------------------------- SLOs and goodput


@dataclass(frozen=True, slots=True)
class SloOutcome:
    ttft_s: float
    tpot_s: float | None
    meets_ttft: bool
    meets_tpot: bool
    meets: bool  # sm.meets_slo: every target


def slo_outcomes(timings: Sequence[sm.RequestTiming], slo: sm.Slo) -> list[SloOutcome]:
    """Each request's TTFT and TPOT (from its schedule) and which targets it met."""
    out = []
    for t in timings:
        ttft = sm.ttft_s(t.scheduled_s, t.token_times_s)
        tpot = sm.tpot_s(t.scheduled_s, t.token_times_s, t.end_s)
        ok_ttft = slo.ttft_s is None or ttft <= slo.ttft_s
        ok_tpot = slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s
        out.append(SloOutcome(ttft, tpot, ok_ttft, ok_tpot, sm.meets_slo(t, slo)))
    return out


def plot_slo_requests(
    runs: Sequence[tuple[str, Sequence[sm.RequestTiming]]], slo: sm.Slo
) -> Figure:
    """One panel per run: each request at its (TTFT, TPOT), filled when it met both targets
    (it counts toward goodput), hollow when it missed one; the SLO is the shaded corner."""
    fig = Figure(figsize=(PAGE_WIDTH_IN, 3.8))
    axes = fig.subplots(1, len(runs), sharey=True)
    axes = list(axes) if len(runs) > 1 else [axes]
    for ax, (title, timings) in zip(axes, runs, strict=True):
        outcomes = [o for o in slo_outcomes(timings, slo) if o.tpot_s is not None]
        good = [o for o in outcomes if o.meets]
        bad = [o for o in outcomes if not o.meets]
        ax.axvline(slo.ttft_s * 1e3, color=color("memory"), ls="--", lw=1)
        ax.axhline(slo.tpot_s * 1e3, color=color("memory"), ls="--", lw=1)
        ax.scatter(
            [o.ttft_s * 1e3 for o in good],
            [o.tpot_s * 1e3 for o in good],
            color=color("memory"),
            s=30,
            label="met both",
            zorder=3,
        )
        ax.scatter(
            [o.ttft_s * 1e3 for o in bad],
            [o.tpot_s * 1e3 for o in bad],
            facecolors="none",
            edgecolors=color("accent"),
            s=30,
            label="missed one",
            zorder=3,
        )
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        (x0, x1), (_, y1) = ax.get_xlim(), ax.get_ylim()
        ax.add_patch(
            Rectangle(
                (x0, 0),
                slo.ttft_s * 1e3 - x0,
                slo.tpot_s * 1e3,
                color=color("memory"),
                alpha=0.1,
                lw=0,
            )
        )
        ax.set_xlim(x0, max(x1, slo.ttft_s * 1e3 * 1.3))
        ax.set_ylim(0, max(y1, slo.tpot_s * 1e3 * 1.15))
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_title(f"{title}: {len(good)} of {len(outcomes)} good")
    axes[0].set_ylabel("TPOT (ms)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


# ---------------------------------------------------------------- open and closed loop


def draw_load_loops(num_users: int = 3) -> Canvas:
    """Open loop (a schedule sends; a slow server grows its queue) against closed loop (C
    users each wait for the answer before sending again)."""
    c = Canvas(30, 9.4)
    c.text(7.3, 8.9, "open loop: a schedule", size=11)
    arr = c.box(0.3, 3.6, 4.0, 2.2, "arrivals\nλ per second", "free")
    for k in range(4):
        c.box(5.3 + 0.85 * k, 4.1, 0.7, 1.2, "", "request", fill=0.4, rounded=False)
    c.text(6.9, 5.9, "queue", size=10)
    server = c.box(9.4, 3.3, 3.8, 2.8, "server", "compute")
    c.arrow(arr, (5.2, 4.7))
    c.arrow((8.7, 4.7), server)
    c.arrow(server, (14.3, 4.7), "done", label_offset=(0, 0.6))
    c.text(7.3, 1.9, "sends never wait:", size=10)
    c.text(7.3, 1.1, "overload grows the queue", size=10)
    c.text(23, 8.9, f"closed loop: C = {num_users} users", size=11)
    c.box(25.6, 3.3, 3.8, 2.8, "server", "compute")
    for k in range(num_users):
        u = c.box(16.4, 1.0 + 2.6 * k, 3.2, 1.6, f"user {k + 1}", "request", fill=0.75)
        ux, uy, uw, uh = u
        c.arrow((ux + uw, uy + uh * 0.7), (25.6, 4.3 + 0.35 * k), kind="compute")
        c.arrow((25.6, 4.1 + 0.35 * k), (ux + uw, uy + uh * 0.3), kind="memory")
    c.text(22.6, 0.35, "send (orange), answer (green):", size=10)
    c.text(22.6, -0.35, "at most C in flight", size=10)
    c.ax.set_ylim(-0.9, 9.4)
    return c


# ---------------------------------------------------------------- routing


def route_requests(
    bodies: Sequence[dict], replicas: Sequence[str], policy: str, lasts: Sequence[int]
) -> list[str]:
    """The replica `Router.choose` gives each request body in turn, for `policy`. Request i
    stays in flight (counted in the router's `outstanding`, as its proxy counts them) while
    the next `lasts[i]` requests are routed; then it finishes."""
    router = Router(replicas, policy)
    chosen: list[str] = []
    for i, body in enumerate(bodies):
        for j in range(i):
            if j + lasts[j] == i:  # request j ends as request i arrives
                router.outstanding[chosen[j]] -= 1
        replica = router.choose(body)
        router.outstanding[replica] += 1
        chosen.append(replica)
    return chosen


def draw_router(
    bodies: Sequence[dict],
    names: Sequence[str],
    replicas: Sequence[str],
    lasts: Sequence[int],
    policies: Sequence[str] = ("round_robin", "least_outstanding", "prefix_aware"),
    tenant_of=lambda name: name[0],
) -> Canvas:
    """The replica each policy sends each request to (`Router.choose`, in arrival order):
    a column per policy, a box per replica listing its requests, coloured by tenant; a
    request lasts while the next `lasts[i]` arrive (least outstanding sees that).
    `canvas.assignment[policy]` is the list of replicas chosen."""
    short = [r.rstrip("/").rsplit(":", 1)[-1] for r in replicas]
    tenants = sorted({tenant_of(n) for n in names})
    kinds = ["request", "compute", "memory", "host", "accent"]
    col_w = 10.0
    row_h = 2.4
    c = Canvas(col_w * len(policies), len(replicas) * row_h + 1.6)
    c.assignment = {}
    routed = {p: route_requests(bodies, replicas, p, lasts) for p in policies}
    most = max(max(ch.count(r) for r in replicas) for ch in routed.values())
    slot = min(1.45, (col_w - 2.6) / most)
    for p, policy in enumerate(policies):
        chosen = routed[policy]
        c.assignment[policy] = chosen
        x0 = p * col_w
        c.text(x0 + col_w / 2, c.height - 0.6, policy.replace("_", " "), size=11)
        for k, (replica, label) in enumerate(zip(replicas, short, strict=True)):
            y = c.height - 1.4 - (k + 1) * row_h + 0.2
            c.box(x0 + 0.3, y, col_w - 0.6, row_h - 0.3, "", "free", fill=0.85)
            c.text(
                x0 + 0.6,
                y + (row_h - 0.3) / 2,
                f":{label}",
                ha="left",
                size=9,
                color=PALETTE["muted"],
            )
            mine = [n for n, r in zip(names, chosen, strict=True) if r == replica]
            for j, n in enumerate(mine):
                c.box(
                    x0 + 2.3 + slot * j,
                    y + 0.35,
                    slot - 0.12,
                    row_h - 1.0,
                    n,
                    kinds[tenants.index(tenant_of(n)) % len(kinds)],
                    fontsize=9,
                )
    return c


# ---------------------------------------------------------------- the token bucket


@dataclass(frozen=True, slots=True)
class BucketEvent:
    time_s: float
    tokens: float
    wait_s: float  # 0: admitted; else the 429's wait (Retry-After rounds it up)
    level_after: float


def replay_bucket(
    rate: float, burst: float, requests: Sequence[tuple[float, float]], step_s: float = 0.05
) -> tuple[list[tuple[float, float]], list[BucketEvent]]:
    """Play (time, tokens) requests into a real `TokenBucket` on a fake clock: its level
    sampled every `step_s` seconds, and each request's answer."""
    now = [0.0]
    bucket = TokenBucket(rate, burst, clock=lambda: now[0])
    end = max(t for t, _ in requests) + 2.0
    samples, events = [], []
    pending = sorted(requests)
    t = 0.0
    while t <= end + EPSILON:
        while pending and pending[0][0] <= t + EPSILON:
            at, tokens = pending.pop(0)
            now[0] = at
            samples.append((at, bucket.level))
            wait = bucket.try_take(tokens)
            events.append(BucketEvent(at, tokens, wait, bucket.level))
            samples.append((at, bucket.level))
        now[0] = t
        samples.append((t, bucket.level))
        t += step_s
    samples.sort(key=lambda s: s[0])
    return samples, events


def plot_token_bucket(rate: float, burst: float, requests: Sequence[tuple[float, float]]) -> Figure:
    """The bucket's level over time (tokens), each request's cost as a bar at its arrival:
    admitted (green) drops the level; refused (red) leaves it and answers 429 with the wait
    until the request would fit."""
    import math

    samples, events = replay_bucket(rate, burst, requests)
    fig = Figure(figsize=(PAGE_WIDTH_IN, 3.2))
    ax = fig.subplots()
    ax.plot(
        [s[0] for s in samples],
        [s[1] for s in samples],
        color=color("request"),
        label="tokens in the bucket",
    )
    ax.axhline(burst, color=PALETTE["muted"], ls=":", lw=1)
    ax.text(
        max(t for t, _ in samples),
        burst * 1.02,
        f"burst {burst:.0f}",
        ha="right",
        color=PALETTE["muted"],
        va="bottom",
    )
    for _k, e in enumerate(events):
        ok = e.wait_s == 0
        ax.bar(
            e.time_s, e.tokens, width=0.12, color=color("memory" if ok else "accent"), alpha=0.55
        )
        text = "admitted" if ok else f"429\nRetry-After\n{math.ceil(e.wait_s - EPSILON)} s"
        ax.annotate(
            f"{e.tokens:.0f}:\n{text}",
            (e.time_s, e.tokens),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize=9,
            va="bottom",
        )
    ax.set_ylim(0, burst * 1.35)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens")
    ax.set_title(f"A token bucket: {rate:.0f} tokens/s, burst {burst:.0f}")
    fig.tight_layout()
    fig.events = events
    return fig


# ---------------------------------------------------------------- autoscaling and cold start


def draw_autoscaler(cold) -> Canvas:
    """The autoscaler's control loop (replicas' queue depth and KV usage in, a replica
    more or fewer out) and the new replica's cold start, its phases drawn to scale from a
    measured `ColdStart`; the loop must act a whole cold start before the queue forms."""
    phases = cold.phases()
    total = sum(phases.values())
    c = Canvas(30, 10.5)
    r1 = c.box(0.4, 6.6, 5.2, 1.6, "replica 1", "compute")
    r2 = c.box(0.4, 4.6, 5.2, 1.6, "replica 2", "compute")
    sig = c.box(8.6, 5.4, 6.8, 2.2, "metrics: queue depth,\nKV usage", "host", fill=0.7)
    dec = c.box(18.4, 5.4, 5.6, 2.2, "autoscaler:\nover target?", "accent", fill=0.75)
    new = c.box(26.0, 5.4, 3.6, 2.2, "new\nreplica", "compute", dashed=True, fill=0.85)
    c.arrow(r1, sig, sides=("right", "left"))
    c.arrow(r2, sig, sides=("right", "left"))
    c.arrow(sig, dec)
    c.arrow(dec, new, "launch", label_offset=(0, 0.75))
    c.arrow(
        (27.8, 7.6),
        (3.0, 8.2),
        "ready: the router sends it traffic",
        curve=0.12,
        kind="muted",
        label_offset=(0, 1.3),
    )
    c.text(0.4, 3.3, f"its cold start, measured here: {total:.1f} s", ha="left", size=11)
    x = 0.4
    span = 29.2
    kinds = ["free", "host", "host", "memory", "memory", "compute", "request"]
    for k, (name, seconds) in enumerate(phases.items()):
        w = span * seconds / total
        c.box(x, 1.2, max(w, 0.05), 1.4, "", kinds[k % len(kinds)], rounded=False)
        if w > 3.2:
            c.text(x + w / 2, 1.9, f"{name.replace('_', ' ')}\n{seconds:.2f} s", size=9)
        x += w
    small = [
        f"{n.replace('_', ' ')} {s * 1e3:.0f} ms"
        for n, s in phases.items()
        if span * s / total <= 3.2
    ]
    if small:
        c.text(
            0.4, 0.5, "short phases: " + ", ".join(small), ha="left", size=9, color=PALETTE["muted"]
        )
    c.phases = phases
    return c


# ---------------------------------------------------------------- two engines


ENGINE_PROCESSES = {
    "vLLM V1 (0.11)": [
        ("API server: FastAPI, AsyncLLM\n(tokenize, OutputProcessor)", "request"),
        ("EngineCore process\nScheduler + KVCacheManager", "host"),
        ("Worker: GPUModelRunner\nforward + sampler", "compute"),
    ],
    "SGLang (0.5)": [
        ("HTTP server + TokenizerManager", "request"),
        ("Scheduler process per GPU\nRadixCache + overlap loop", "host"),
        ("TpModelWorker: ModelRunner\nforward + sampler", "compute"),
        ("DetokenizerManager process", "request"),
    ],
}


def draw_engine_processes(layouts=ENGINE_PROCESSES) -> Canvas:
    """Each engine's processes top to bottom, in the order a request passes them; the
    arrows between processes are ZeroMQ sockets."""
    tallest = max(len(v) for v in layouts.values())
    col_w = 15.0
    c = Canvas(col_w * len(layouts), tallest * 2.5 + 1.2)
    for i, (title, boxes) in enumerate(layouts.items()):
        x0 = i * col_w
        c.text(x0 + col_w / 2, c.height - 0.5, title, size=11)
        prev = None
        for k, (label, kind) in enumerate(boxes):
            b = c.box(
                x0 + 1.0,
                c.height - 1.2 - (k + 1) * 2.5 + 0.4,
                col_w - 3.4,
                1.9,
                label,
                kind,
                fontsize=10,
            )
            if prev is not None:
                c.arrow(prev, b, sides=("bottom", "top"))
            prev = b
        c.text(
            x0 + col_w - 1.4, c.height / 2, "ZeroMQ", rotation=90, size=9, color=PALETTE["muted"]
        )
    return c


# ---------------------------------------------------------------- multi-LoRA


def draw_multi_lora(adapters: Sequence[str | None], rank: int = 8, hidden: int = 4096) -> Canvas:
    """One step of multi-LoRA serving: the batch's rows share the base weight W (one
    GEMM), and each row adds its own adapter's x·Aᵀ·Bᵀ (rank r), or nothing (None: the base
    model alone). `adapters` are the requests' `LoRARequest.lora_name`s."""
    names = sorted({a for a in adapters if a is not None})
    kinds = ["compute", "memory", "host", "accent"]
    n = len(adapters)
    row_h = 1.3
    c = Canvas(30, n * row_h + 2.0)
    top = c.height - 1.4
    c.text(2.2, c.height - 0.6, "batch rows", size=10)
    c.text(11.0, c.height - 0.6, f"base W [{hidden}, {hidden}]: one GEMM", size=10)
    c.text(21.3, c.height - 0.6, f"adapter, rank {rank}", size=10)
    w = c.box(7.0, top - n * row_h + 0.1, 8.0, n * row_h - 0.1, "x Wᵀ\nshared", "request", fill=0.7)
    for i, a in enumerate(adapters):
        y = top - (i + 1) * row_h + 0.15
        row = c.box(0.3, y, 4.0, row_h - 0.25, f"request {i}", "free", fill=0.75, fontsize=9)
        c.arrow(row, (7.0, y + (row_h - 0.25) / 2))
        if a is None:
            c.box(17.6, y, 7.4, row_h - 0.25, "base only", "free", fill=0.9, fontsize=9)
        else:
            c.box(
                17.6,
                y,
                7.4,
                row_h - 0.25,
                f"+ x Aᵀ Bᵀ of {a}",
                kinds[names.index(a) % len(kinds)],
                fontsize=9,
            )
        c.arrow((15.0, y + (row_h - 0.25) / 2), (17.6, y + (row_h - 0.25) / 2))
        c.text(26.8, y + (row_h - 0.25) / 2, f"y{i}", size=10)
    del w
    return c


# ---------------------------------------------------------------- the service layer

# minillm's parts a fleet is made of, top (the request's entry) to bottom, with the file
# that holds each (the autoscaler is a model of one, in the book's instruments)
SERVICE_PARTS = {
    "router": "minillm/serve/router.py",
    "autoscaler": "minillm/lab/autoscale.py",
    "engine": "minillm/engine/llm_engine.py",
    "KV cache": "minillm/core/kv_cache_manager.py",
    "metrics": "minillm/serve/metrics.py",
}

# what each open system of the service layer provides in place of a minillm part; a part
# a system leaves to another is absent from its row
SERVICE_SYSTEMS = {
    "llm-d": {
        "router": "inference scheduler:\nprefix, KV, queue scorers",
        "autoscaler": "left to Kubernetes\n(HPA, KEDA)",
        "engine": "vLLM pods",
        "KV cache": "P/D transfer\nwith NIXL",
        "metrics": "scorers read\nvllm:* metrics",
    },
    "NVIDIA Dynamo": {
        "router": "KV router on\nworkers' KV events",
        "autoscaler": "Planner: P and D\npools to an SLO",
        "engine": "vLLM, SGLang or\nTensorRT-LLM workers",
        "KV cache": "disaggregated P/D,\nKV transfer (NIXL)",
    },
    "KServe": {
        "router": "through llm-d\n(LLMInferenceService)",
        "autoscaler": "Knative (to zero)\nor HPA / KEDA",
        "engine": "InferenceService:\na vLLM runtime",
    },
    "KEDA": {
        "autoscaler": "ScaledObject: any\nmetric, to and from 0",
        "metrics": "reads Prometheus:\nnum_requests_waiting",
    },
}


def draw_service_layer(parts=SERVICE_PARTS, systems=SERVICE_SYSTEMS) -> Canvas:
    """The service layer on one map: minillm's parts down the left, in the order a request
    meets them, and for each open system a column holding what it provides in place of each
    part (a blank where it leaves that part to another system)."""
    unknown = sorted({p for row in systems.values() for p in row} - set(parts))
    if unknown:
        raise ValueError(f"systems name parts {unknown} that are not among {list(parts)}")
    row_h, part_w, col_w = 2.3, 7.4, 7.6
    c = Canvas(part_w + 0.6 + col_w * len(systems), row_h * len(parts) + 1.4)
    top = c.height - 1.2
    c.text(part_w / 2 + 0.2, c.height - 0.55, "minillm", size=11)
    kinds = ["request", "accent", "compute", "memory", "host"]
    for i, (part, path) in enumerate(parts.items()):
        y = top - (i + 1) * row_h + 0.2
        c.box(
            0.2,
            y,
            part_w,
            row_h - 0.4,
            f"{part}\n{path.removeprefix('minillm/')}",
            kinds[i % len(kinds)],
            fill=0.6,
            fontsize=9,
        )
    for j, (name, row) in enumerate(systems.items()):
        x = part_w + 0.6 + j * col_w
        c.text(x + col_w / 2, c.height - 0.55, name, size=11)
        for i, part in enumerate(parts):
            if part in row:
                y = top - (i + 1) * row_h + 0.2
                c.box(
                    x + 0.2,
                    y,
                    col_w - 0.4,
                    row_h - 0.4,
                    row[part],
                    kinds[i % len(kinds)],
                    fill=0.85,
                    fontsize=8,
                )
    return c


__all__ = [
    "BucketEvent",
    "SloOutcome",
    "draw_autoscaler",
    "draw_engine_processes",
    "draw_load_loops",
    "draw_multi_lora",
    "draw_request_timeline",
    "draw_router",
    "draw_service_layer",
    "plot_slo_requests",
    "plot_token_bucket",
    "replay_bucket",
    "route_requests",
    "slo_outcomes",
]
