"""Chapter 4's pictures: the scheduler loop, the slots of a batch, a step's token plan, and
what each engine's admission rule books in the KV pool.

The flowchart names the real functions of `minillm.core.scheduler` (`SCHEDULER_LOOP`); the
other drawings are made from engine traces (`StepTrace`) and from `minillm.lab.admission`'s
rules, so the picture changes when the engine's state does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minillm.core.metrics import StepTrace
from minillm.lab.admission import (
    SGLANG_INIT_NEW_TOKEN_RATIO,
    PoolEntry,
    PoolRequest,
    admit_sglang,
    admit_trtllm,
    admit_vllm,
)
from minillm.lab.batch_slots import slot_timeline
from minillm.lab.diagrams.canvas import Canvas
from minillm.lab.figures import PAGE_WIDTH_IN, PALETTE, SERIES

# a request's colour: the series colours less the grey, which an empty slot uses
REQUEST_COLORS = [c for c in SERIES if c != "#8C8C8C"]

# The scheduler loop, box by box: (the function that does it, what it does). Each name is
# "Class.method" in minillm.core (tests check that every one exists).
SCHEDULER_LOOP: tuple[tuple[str, str], ...] = (
    ("Scheduler.schedule", "start a step: token budget = max_num_batched_tokens"),
    (
        "Scheduler._schedule_running",
        "running requests first, oldest first:\neach gets min(tokens left, budget left)",
    ),
    (
        "Scheduler._allocate_or_preempt",
        "blocks for those tokens, or preempt\nuntil they fit",
    ),
    (
        "Scheduler._schedule_waiting",
        "no preemption this step: admit waiting requests\n"
        "while budget, seats and blocks remain;\n"
        "a prompt longer than the budget gets a chunk",
    ),
    (
        "Scheduler.update_from_output",
        "the model runs the step; new tokens appended,\nfinished requests free their blocks",
    ),
)
SCHEDULER_SIDE: tuple[tuple[str, str], ...] = (
    ("KVCacheManager.allocate_slots", "blocks from the free list"),
    (
        "Scheduler._preempt",
        "victim: the newest request\n(_preemption_victim); its KV\nfreed, requeued at the front",
    ),
    (
        "Scheduler._admission_order",
        "waiting_order: fcfs, priority or sjf;\nstatic batches wait for the last",
    ),
)


def loop_function_names() -> list[str]:
    """Every function the flowchart names, as "Class.method"."""
    return [name for name, _ in SCHEDULER_LOOP + SCHEDULER_SIDE]


def _short(name: str) -> str:
    return name.split(".", 1)[1] if name.startswith("Scheduler.") else name


def draw_scheduler_loop() -> Canvas:
    """One engine step as a flowchart: each box is a function of the scheduler."""
    c = Canvas(20, 15)
    heights = (1.3, 1.6, 1.6, 2.1, 1.6)
    tops = (14.6, 12.3, 10.0, 6.3, 2.0)
    kinds = ("host", "request", "memory", "request", "compute")
    main = []
    for (name, what), h, top, kind in zip(SCHEDULER_LOOP, heights, tops, kinds, strict=True):
        main.append(c.box(1.2, top - h, 11.0, h, f"{_short(name)}\n{what}", kind, fontsize=10))
    for a, b in zip(main, main[1:], strict=False):
        c.arrow(a, b, sides=("bottom", "top"))
    side = [
        c.box(13.0, top - h, 6.7, h, f"{_short(name)}\n{what}", kind, fontsize=10)
        for (name, what), top, h, kind in zip(
            SCHEDULER_SIDE,
            (10.0, 8.0, 5.9),
            (1.6, 1.9, 1.9),
            ("memory", "accent", "host"),
            strict=True,
        )
    ]
    c.arrow(main[2], side[0], sides=("right", "left"), dashed=True)
    c.arrow(side[0], side[1], "none free", sides=("bottom", "top"), label_offset=(1.3, 0.0))
    c.arrow(side[2], main[3], sides=("left", "right"), dashed=True)
    # the engine loops: the next step plans anew (continuous batching)
    x = 0.5
    bottom = main[4][1] + main[4][3] / 2
    top = main[0][1] + main[0][3] / 2
    c.ax.plot([main[4][0], x, x], [bottom, bottom, top], color=PALETTE["ink"], lw=1.3)
    c.arrow((x, top), (main[0][0], top))
    c.text(
        x - 0.1,
        (bottom + top) / 2,
        "next step",
        rotation=90,
        size=10,
        color=PALETTE["muted"],
        ha="right",
    )
    return c


def plot_slot_timeline(ax, traces: Sequence[StepTrace], num_slots: int, title: str) -> None:
    """Which request holds each slot at each step: one coloured bar per stay in the batch."""
    timeline = slot_timeline(traces, num_slots)
    for slot in range(num_slots):
        step = 0
        while step < len(timeline):
            request_id = timeline[step][slot]
            end = step
            while end + 1 < len(timeline) and timeline[end + 1][slot] == request_id:
                end += 1
            span = [(step, end + 1 - step)]
            if request_id is None:
                ax.broken_barh(span, (slot - 0.4, 0.8), color=PALETTE["free"])
            else:
                color = REQUEST_COLORS[int(request_id) % len(REQUEST_COLORS)]
                ax.broken_barh(span, (slot - 0.4, 0.8), color=color, edgecolor="white")
                if end + 1 - step >= 4:
                    ax.text(
                        (step + end + 1) / 2,
                        slot,
                        request_id,
                        ha="center",
                        va="center",
                        fontsize=9,
                        color="white",
                    )
            step = end + 1
    ax.set_yticks(range(num_slots))
    ax.set_ylabel("slot")
    ax.set_xlabel("engine step")
    ax.set_title(title)
    ax.grid(False)


def slot_timeline_figure(runs: Mapping[str, Sequence[StepTrace]], num_slots: int) -> Figure:
    """One slot timeline per batching type, stacked, on a shared step axis."""
    fig = Figure(figsize=(PAGE_WIDTH_IN, 1.2 + 1.9 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, traces) in zip(axes, runs.items(), strict=True):
        plot_slot_timeline(ax, traces, num_slots, f"{name}: {len(traces)} steps")
    for ax in axes[:-1]:
        ax.set_xlabel("")
        ax.tick_params(labelbottom=True)
    return fig


def plot_token_plan(
    ax, traces: Sequence[StepTrace], budget: int, names: Mapping[str, str], legend: bool = True
) -> None:
    """Stacked bars: each step's tokens by request, hatched for prefill; the budget a line."""
    ids = list(names)
    for trace in traces:
        bottom = 0
        for rid, n, phase in trace.scheduled:
            ax.bar(
                trace.step,
                n,
                bottom=bottom,
                color=REQUEST_COLORS[ids.index(rid) % len(REQUEST_COLORS)],
                edgecolor="black",
                linewidth=0.6,
                hatch="//" if phase == "prefill" else None,
                width=0.7,
            )
            bottom += n
    ax.axhline(budget, color="black", linestyle="--", linewidth=1)
    ax.text(len(traces) - 0.6, budget, f"budget {budget}", va="bottom", ha="right", fontsize=9)
    ax.set_ylim(0, budget * (1.5 if legend else 1.3))
    ax.set_xticks([t.step for t in traces])
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in the step")
    ax.grid(axis="x", visible=False)
    if legend:
        handles = [
            Rectangle((0, 0), 1, 1, color=REQUEST_COLORS[i % len(REQUEST_COLORS)])
            for i in range(len(ids))
        ]
        handles.append(Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"))
        ax.legend(
            handles,
            [*names.values(), "prefill (hatched)"],
            loc="upper right",
            ncol=len(handles),
            handlelength=1.2,
            columnspacing=1.0,
        )


# what a newly admitted request books in the pool under each rule, beyond its prompt
_RULES = {
    "vllm": (admit_vllm, "prompt only"),
    "sglang": (admit_sglang, "prompt + max_tokens"),
    "trtllm": (admit_trtllm, "prompt + max_tokens"),
}


def admission_bookings(
    policy: str, requests: Sequence[PoolRequest], capacity_slots: int, one_step_later: bool = False
) -> list[tuple[str, int, int]]:
    """(request id, slots held, slots booked for its output) of each request `policy` has
    admitted on the empty pool, in admission order. With `one_step_later`, the first
    admissions have run one step (one output token each) and the rule admits again: SGLang
    then counts a running request's remaining max_tokens at its forecast ratio."""
    admit, _ = _RULES[policy]
    by_id = {r.request_id: r for r in requests}
    waiting = [PoolEntry(r) for r in requests]
    first = admit(waiting, [], capacity_slots)
    running = [PoolEntry(by_id[i], num_generated=1 if one_step_later else 0) for i in first]
    out = [(e.request.request_id, e.num_slots_held, _booked(policy, e)) for e in running]
    if one_step_later:
        rest = [e for e in waiting if e.request.request_id not in set(first)]
        for i in admit(rest, running, capacity_slots):
            e = PoolEntry(by_id[i])
            out.append((i, e.num_slots_held, _booked(policy, e)))
    return out


def _booked(policy: str, entry: PoolEntry) -> int:
    """Slots the rule keeps for a request's future output beyond what it holds."""
    if policy == "vllm":
        return 0
    if policy == "sglang" and entry.num_generated:
        return round(SGLANG_INIT_NEW_TOKEN_RATIO * entry.num_remaining_tokens)
    return entry.num_remaining_tokens


def draw_admission(
    requests: Sequence[PoolRequest],
    capacity_slots: int,
    rows: Sequence[tuple[str, str, bool]],
) -> Canvas:
    """The pool after each engine's admissions, one bar per (policy, title, one_step_later)
    row: each admitted request's KV slots (solid), what the rule books for its output
    (light), and what stays free."""
    c = Canvas(20, 2.2 * len(rows) + 1.2)
    x0, width = 0.3, 19.4
    scale = width / capacity_slots
    for row, (policy, name, later) in enumerate(rows):
        y = 2.2 * (len(rows) - 1 - row) + 1.3
        bookings = admission_bookings(policy, requests, capacity_slots, later)
        x = x0
        for _, held, booked in bookings:
            c.box(x, y, held * scale, 0.8, kind="memory", fill=0.1, rounded=False)
            x += held * scale
            if booked:
                c.box(x, y, booked * scale, 0.8, kind="memory", fill=0.8, rounded=False)
                x += booked * scale
        c.box(x, y, max(x0 + width - x, 0), 0.8, kind="free", fill=0.6, rounded=False)
        held = sum(h for _, h, _ in bookings)
        taken = sum(h + b for _, h, b in bookings)
        # an invisible box: the row's caption, which labels() reads back
        c.box(
            x0,
            y + 0.85,
            width,
            0.8,
            f"{name}: {len(bookings)} admitted, {held:,} slots "
            f"held, {taken:,} of {capacity_slots:,} taken",
            kind="#ffffff",
            fill=0,
            fontsize=10,
        )
    c.box(x0, 0.15, 0.6, 0.5, kind="memory", fill=0.1, rounded=False)
    c.text(x0 + 0.8, 0.4, "KV held (prompt)", ha="left", size=10)
    c.box(x0 + 5.6, 0.15, 0.6, 0.5, kind="memory", fill=0.8, rounded=False)
    c.text(x0 + 6.4, 0.4, "booked for output", ha="left", size=10)
    c.box(x0 + 11.6, 0.15, 0.6, 0.5, kind="free", fill=0.6, rounded=False)
    c.text(x0 + 12.4, 0.4, "free", ha="left", size=10)
    return c


__all__ = [
    "SCHEDULER_LOOP",
    "SCHEDULER_SIDE",
    "admission_bookings",
    "draw_admission",
    "draw_scheduler_loop",
    "loop_function_names",
    "plot_slot_timeline",
    "plot_token_plan",
    "slot_timeline_figure",
]
