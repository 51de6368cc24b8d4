"""Chapter 8's diagrams: how a model is split over GPUs and what the GPUs exchange.

Where the picture is the engine's state it is computed by the engine's own functions: the
tensor-parallel shard shapes by `minillm.distributed.tensor_parallel.shard_tensor`, the
vocabulary ranges by `parallel_layers.vocab_range`, the pipeline's stages by
`pipeline.stage_layers`, the experts a rank holds by `expert_parallel.expert_range`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from minillm.distributed.expert_parallel import expert_range, token_share
from minillm.distributed.parallel_layers import vocab_range
from minillm.distributed.pipeline import stage_layers
from minillm.distributed.tensor_parallel import shard_tensor
from minillm.lab.diagrams.canvas import Canvas
from minillm.lab.parallel import pipeline_bubble_fraction

# one colour per GPU (rank), in order
RANK_KINDS = ("request", "compute", "memory", "host")


def rank_kind(rank: int) -> str:
    return RANK_KINDS[rank % len(RANK_KINDS)]


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


# ---------------------------------------------------------------- the six layouts


def draw_layouts() -> Canvas:
    """What each kind of parallelism splits, on two GPUs: six small panels."""
    c = Canvas(30, 19)
    panels = [
        ("data parallelism", 0, 10),
        ("tensor parallelism", 10, 10),
        ("pipeline parallelism", 20, 10),
        ("expert parallelism", 0, 0),
        ("sequence parallelism", 10, 0),
        ("context parallelism", 20, 0),
    ]
    for title, x0, y0 in panels:
        c.text(x0 + 5, y0 + 8.6, title)
    k0, k1 = rank_kind(0), rank_kind(1)
    # DP: two whole copies, each with its own requests
    for g, kind in enumerate((k0, k1)):
        for layer in range(3):
            c.box(0.5 + 4.7 * g, 10.6 + 1.9 * layer, 4.2, 1.6, f"layer {layer}", kind)
        c.text(2.6 + 4.7 * g, 16.6, "A, B" if g == 0 else "C, D", size=10)
    # TP: every layer in halves
    for layer in range(3):
        c.box(10.5, 10.6 + 1.9 * layer, 4.4, 1.6, "½ W", k0)
        c.box(15.1, 10.6 + 1.9 * layer, 4.4, 1.6, "½ W", k1)
    c.text(15, 16.6, "every request", size=10)
    # PP: consecutive layers per GPU
    for layer in range(4):
        c.box(21.5, 10.4 + 1.55 * layer, 5, 1.3, f"layer {layer}", k0 if layer < 2 else k1)
    c.arrow((27.2, 11.5), (27.2, 14.2), "act.", label_offset=(1.1, 0))
    # EP: attention on every GPU, experts split
    c.box(0.5, 5.4, 9, 1.5, "attention (both)", "free")
    for e in range(8):
        c.box(0.5 + 1.125 * e, 2.2, 1.05, 2.2, f"E{e}", k0 if e < 4 else k1, fontsize=9)
    c.text(5, 1.2, "tokens go to their experts", size=10)
    # SP: matmuls by TP, norm and residual by token
    c.box(10.5, 5.4, 9, 1.5, "matmuls: by TP", "free")
    for t in range(8):
        c.box(10.5 + 1.125 * t, 2.2, 1.05, 2.2, f"t{t}", k0 if t < 4 else k1, fontsize=9)
    c.text(15, 1.2, "norm, residual: by token", size=10)
    # CP: one long sequence's KV by position
    c.text(25, 6.2, "one long sequence", size=10)
    for t in range(8):
        c.box(20.5 + 1.125 * t, 2.2, 1.05, 2.2, f"{t}", k0 if t < 4 else k1, fontsize=9)
    c.text(25, 1.2, "its KV, split by position", size=10)
    return c


# ---------------------------------------------------------------- tensor parallelism


def tensor_parallel_mlp_shards(model, tp: int, layer: int = 0) -> dict[str, list[torch.Tensor]]:
    """Each rank's slice of one layer's MLP weights, cut by the engine's `shard_tensor`."""
    config = model.config
    state = {name: t for name, t in model.state_dict().items() if f"layers.{layer}.mlp." in name}
    shards: dict[str, list[torch.Tensor]] = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.{layer}.mlp.{proj}.weight"
        shards[proj] = [shard_tensor(name, state[name], config, r, tp) for r in range(tp)]
    return shards


def draw_tensor_parallel_mlp(model, tp: int, num_tokens: int = 5, layer: int = 0) -> Canvas:
    """One decoder MLP of `model` under `tp`-way tensor parallelism: column-parallel gate
    and up, row-parallel down, then the all-reduce. Shapes are the real shards' (weights
    stored [out, in], as `nn.Linear` does)."""
    shards = tensor_parallel_mlp_shards(model, tp, layer)
    hidden = model.config.hidden_size
    inter = shards["gate_proj"][0].shape[0]
    row_h = 3.0
    height = tp * row_h + 1.8
    c = Canvas(31, height)
    xbox = c.box(0.2, height / 2 - 1.5, 3.6, 3.0, f"x\n[{num_tokens}, {hidden}]\nevery GPU", "free")
    c.text(10.6, height - 0.9, "column-parallel: no exchange", size=10, color="#6F6F6F")
    c.text(19.5, height - 0.9, "row-parallel", size=10, color="#6F6F6F")
    partials = []
    for r in range(tp):
        y = height - 1.6 - (r + 1) * row_h + 0.3
        kind = rank_kind(r)
        gu = c.box(
            5.0, y, 5.6, 2.4, f"GPU {r}: gate, up\n{_shape(shards['gate_proj'][r])} each", kind
        )
        act = c.box(11.6, y, 4.6, 2.4, f"silu(g)·u\n[{num_tokens}, {inter}]", kind, fill=0.8)
        down = c.box(17.2, y, 4.6, 2.4, f"down\n{_shape(shards['down_proj'][r])}", kind)
        part = c.box(22.8, y, 3.4, 2.4, f"partial\n[{num_tokens}, {hidden}]", kind, fill=0.8)
        c.arrow(xbox, gu, sides=("right", "left"))
        c.arrow(gu, act)
        c.arrow(act, down)
        c.arrow(down, part)
        partials.append(part)
    total = c.box(
        27.4,
        height / 2 - 1.5,
        3.4,
        3.0,
        f"Σ all-\nreduce\n[{num_tokens}, {hidden}]",
        "accent",
        fill=0.7,
    )
    for part in partials:
        c.arrow(part, total, sides=("right", "left"))
    return c


def draw_vocab_parallel(token_ids: Sequence[int], vocab_size: int, tp: int) -> Canvas:
    """A vocabulary-parallel embedding lookup: each rank looks up the ids in its range
    (`vocab_range`) and writes zeros for the others; the all-reduce sums the rows."""
    ranges = [vocab_range(vocab_size, r, tp) for r in range(tp)]
    n = len(token_ids)
    row_h = 2.8
    height = tp * row_h + 0.6
    width = 8.5 + 3.4 * n + 4 + 2.2 * n
    c = Canvas(width, height)
    sources = []
    for r, (lo, hi) in enumerate(ranges):
        y = height - (r + 1) * row_h
        c.text(0.2, y + 1.1, f"GPU {r}\nrows {lo}–{hi - 1}", ha="left", size=10)
        for k, token in enumerate(token_ids):
            mine = lo <= token < hi
            label = f"id {token}\nrow {token - lo}" if mine else f"id {token}\nzeros"
            b = c.box(
                5.6 + 3.4 * k,
                y + 0.3,
                3.2,
                1.8,
                label,
                rank_kind(r) if mine else "free",
                fill=0.55 if mine else 0.8,
                fontsize=10,
            )
        sources.append(b)
    x_sum = 5.6 + 3.4 * n + 0.6
    total = c.box(
        x_sum, height / 2 - 1.1, 2.6, 2.2, "Σ all-\nreduce", "accent", fill=0.7, fontsize=10
    )
    for b in sources:
        c.arrow(b, total, sides=("right", "left"))
    for k, token in enumerate(token_ids):
        owner = next(r for r, (lo, hi) in enumerate(ranges) if lo <= token < hi)
        c.box(
            x_sum + 3.4 + 2.2 * k,
            height / 2 - 1.1,
            2.0,
            2.2,
            f"row\n{token}",
            rank_kind(owner),
            fontsize=10,
        )
    return c


# ---------------------------------------------------------------- the ring all-reduce


def ring_all_reduce_states(p: int) -> list[list[list[int]]]:
    """counts[step][rank][chunk]: how many ranks' values chunk `chunk` sums on `rank`,
    at the start and after each of the 2(p - 1) steps of a ring all-reduce (rank r sends to
    r + 1; in reduce-scatter step s it sends chunk r - s, in all-gather step s chunk
    r + 1 - s)."""
    count = [[1] * p for _ in range(p)]
    states = [[row[:] for row in count]]
    for s in range(p - 1):
        new = [row[:] for row in count]
        for r in range(p):
            ch = (r - s) % p
            new[(r + 1) % p][ch] = count[(r + 1) % p][ch] + count[r][ch]
        count = new
        states.append([row[:] for row in count])
    for s in range(p - 1):
        new = [row[:] for row in count]
        for r in range(p):
            ch = (r + 1 - s) % p
            new[(r + 1) % p][ch] = count[r][ch]
        count = new
        states.append([row[:] for row in count])
    return states


def draw_ring_all_reduce(p: int = 4) -> Canvas:
    """Every step of a ring all-reduce over `p` ranks: a row per step, a group of `p`
    chunk cells per rank; each cell says how many ranks' values the chunk sums, and the
    cells that just received (bold) show what moved."""
    states = ring_all_reduce_states(p)
    chunks = "abcdefgh"[:p]
    label_w, gap = 6.2, 0.7
    width = label_w + p * (p + gap)
    height = len(states) * 1.25 + 1.6
    c = Canvas(width, height)
    for r in range(p):
        x0 = label_w + r * (p + gap)
        c.text(x0 + p / 2, height - 0.5, f"GPU {r}", size=10)
    names = ["start"] + [f"reduce-scatter {i + 1}" for i in range(p - 1)]
    names += [f"all-gather {i + 1}" for i in range(p - 1)]
    for step, (state, name) in enumerate(zip(states, names, strict=True)):
        y = height - 1.5 - (step + 1) * 1.25 + 0.15
        c.text(0.1, y + 0.5, name, ha="left", size=10)
        previous = states[step - 1] if step else state
        for r in range(p):
            x0 = label_w + r * (p + gap)
            for ch in range(p):
                n = state[r][ch]
                c.box(
                    x0 + ch,
                    y,
                    0.96,
                    1.05,
                    f"{chunks[ch]}{n}",
                    "request",
                    fill=0.88 - 0.7 * n / p,
                    rounded=False,
                    fontsize=9,
                    bold=n != previous[r][ch],
                    text_color="white" if n == p else None,
                )
    return c


# ---------------------------------------------------------------- pipeline parallelism


def pipeline_schedule(num_stages: int, num_micro: int) -> list[list[int | None]]:
    """slots[stage][t]: the micro-batch `stage` runs in slot t (None: idle), GPipe order:
    micro-batch j reaches stage s in slot s + j."""
    slots = num_micro + num_stages - 1
    return [
        [t - s if 0 <= t - s < num_micro else None for t in range(slots)] for s in range(num_stages)
    ]


def draw_pipeline(
    num_layers: int, num_stages: int, micro_batches: Sequence[int] = (1, 8)
) -> Canvas:
    """The GPipe schedule of a model of `num_layers` layers cut into `num_stages` stages
    (the engine's `stage_layers`), for each number of micro-batches: busy slots numbered by
    micro-batch, idle ones (the bubble) grey."""
    most = max(micro_batches) + num_stages - 1
    label_w = 7.4
    block_h = num_stages * 1.1 + 1.5
    c = Canvas(label_w + most + 0.4, block_h * len(micro_batches))
    for b, m in enumerate(micro_batches):
        top = c.height - b * block_h
        bubble = pipeline_bubble_fraction(num_stages, m)
        word = "micro-batch" if m == 1 else "micro-batches"
        c.text(0.1, top - 0.55, f"{m} {word}: bubble {bubble:.0%}", ha="left", size=11)
        for s, row in enumerate(pipeline_schedule(num_stages, m)):
            lo, hi = stage_layers(num_layers, s, num_stages)
            y = top - 1.4 - (s + 1) * 1.1 + 0.1
            c.text(0.1, y + 0.45, f"stage {s}: L{lo}–{hi - 1}", ha="left", size=10)
            for t, j in enumerate(row):
                if j is None:
                    c.box(label_w + t, y, 0.94, 0.95, "", "free", fill=0.5, rounded=False)
                else:
                    c.box(
                        label_w + t, y, 0.94, 0.95, str(j), rank_kind(s), rounded=False, fontsize=9
                    )
    return c


# ---------------------------------------------------------------- expert parallelism


def draw_expert_dispatch(routes: Mapping[int, Sequence[int]], num_experts: int, ep: int) -> Canvas:
    """Expert parallelism's dispatch: each rank holds the tokens of its share
    (`token_share`) and the experts of its range (`expert_range`); a red arrow is a route
    that crosses GPUs (the all-to-all's traffic), a grey one stays local. Combine runs the
    same routes backwards. `canvas.crossing` counts the red routes."""
    num_tokens = len(routes)
    per_rank = num_experts // ep
    gw = 3.6 + 1.3 * per_rank + 1.2
    c = Canvas(ep * gw + 0.4, 8.0)
    token_boxes, expert_boxes = {}, {}
    for g in range(ep):
        x0 = 0.3 + g * gw
        c.text(x0 + gw / 2 - 0.5, 7.5, f"GPU {g}", size=11)
        lo, hi = token_share(num_tokens, g, ep)
        for k, tok in enumerate(range(lo, hi)):
            label = f"t{tok} → " + ",".join(f"E{e}" for e in routes[tok])
            token_boxes[tok] = c.box(
                x0, 5.0 - 2.0 * k, 3.3, 1.5, label, rank_kind(g), fill=0.75, fontsize=9
            )
        e_lo, e_hi = expert_range(num_experts, g, ep)
        for k, e in enumerate(range(e_lo, e_hi)):
            expert_boxes[e] = c.box(
                x0 + 3.9 + 1.3 * k, 0.8, 1.15, 5.7, f"E{e}", rank_kind(g), fontsize=10
            )
    crossing = 0
    for tok, experts in routes.items():
        src = next(
            g
            for g in range(ep)
            if token_share(num_tokens, g, ep)[0] <= tok < token_share(num_tokens, g, ep)[1]
        )
        for e in experts:
            dst = e // per_rank
            across = dst != src
            crossing += across
            tx, ty, tw, th = token_boxes[tok]
            ex, ey, ew, eh = expert_boxes[e]
            c.arrow(
                (tx + tw, ty + th / 2),
                (ex + ew / 2, ey + eh),
                kind="accent" if across else "muted",
                curve=-0.15,
            )
    c.crossing = crossing
    return c


def draw_dp_attention(num_gpus: int = 4) -> Canvas:
    """An MLA model's latent KV cache under TP attention (every GPU caches every
    sequence's latent) and under DP attention (each GPU its own sequences')."""
    seqs = "ABCDEFGH"[:num_gpus]
    gw = 3.0
    half = num_gpus * gw + 0.6
    c = Canvas(2 * half + 0.6, 3.2 + 0.95 * num_gpus)
    for p, (title, dp) in enumerate(
        ((f"TP={num_gpus}: latents copied", False), ("DP attention: one copy each", True))
    ):
        x_off = p * (half + 0.6)
        c.text(x_off + half / 2, c.height - 0.5, title, size=11)
        for g in range(num_gpus):
            x0 = x_off + 0.3 + g * gw
            c.text(x0 + 1.35, c.height - 1.4, f"GPU {g}", size=10)
            mine = [seqs[g]] if dp else list(seqs)
            for k, s in enumerate(mine):
                c.box(
                    x0,
                    c.height - 2.7 - 0.95 * k,
                    2.7,
                    0.8,
                    f"latent {s}",
                    rank_kind(seqs.index(s)),
                    fontsize=9,
                )
            c.box(x0, 0.2, 2.7, 1.1, "experts (EP)" if dp else "MLP (TP)", "free", fontsize=9)
    return c


# ---------------------------------------------------------------- disaggregation


def draw_disaggregation(
    prefill_slots: int = 4, decode_before: int = 3, decode_after: int = 4
) -> Canvas:
    """Colocated (one GPU: B's prefill stalls A's decode) against disaggregated (a prefill
    GPU computes B's KV and sends it; the decode GPU keeps one step per slot)."""
    width = 2 + decode_before + prefill_slots + decode_after + 11
    c = Canvas(width, 8.6)
    x0 = 5.0

    def steps(y, start, n, label):
        for i in range(n):
            c.box(x0 + start + i, y, 0.92, 0.9, label, "request", fontsize=9, rounded=False)

    c.text(0.1, 7.6, "colocated", ha="left", size=11)
    c.text(0.1, 6.9, "one GPU", ha="left", size=10, color="#6F6F6F")
    steps(6.6, 0, decode_before, "A")
    c.box(
        x0 + decode_before,
        6.6,
        prefill_slots - 0.08,
        0.9,
        "prefill B",
        "compute",
        fontsize=10,
        rounded=False,
    )
    steps(6.6, decode_before + prefill_slots, decode_after, "AB")
    c.arrow(
        (x0 + decode_before, 6.3),
        (x0 + decode_before + prefill_slots, 6.3),
        "A's gap stretches",
        both=True,
        label_offset=(0, -0.55),
    )
    c.text(0.1, 3.9, "prefill GPU", ha="left", size=10)
    c.box(
        x0 + decode_before,
        3.5,
        prefill_slots - 0.08,
        0.9,
        "prefill B",
        "compute",
        fontsize=10,
        rounded=False,
    )
    kv = c.box(
        x0 + decode_before + prefill_slots,
        3.5,
        1.9,
        0.9,
        "KV →",
        "accent",
        fontsize=10,
        rounded=False,
    )
    c.text(0.1, 1.15, "decode GPU", ha="left", size=10)
    n_a = decode_before + prefill_slots + 2
    steps(0.7, 0, n_a, "A")
    steps(0.7, n_a, decode_after, "AB")
    c.arrow((kv[0] + 1.2, kv[1]), (x0 + n_a + 0.45, 1.6), kind="accent")
    c.text(x0 + n_a + decode_after + 0.4, 1.15, "A keeps its pace", ha="left", size=10)
    c.text(
        kv[0] + kv[2] + 0.3, kv[1] + 0.45, "the KV transfer", ha="left", size=10, color="#C44E52"
    )
    return c


__all__ = [
    "draw_disaggregation",
    "draw_dp_attention",
    "draw_expert_dispatch",
    "draw_layouts",
    "draw_pipeline",
    "draw_ring_all_reduce",
    "draw_tensor_parallel_mlp",
    "draw_vocab_parallel",
    "pipeline_schedule",
    "ring_all_reduce_states",
    "tensor_parallel_mlp_shards",
]
