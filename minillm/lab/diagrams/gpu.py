"""Chapter 5's pictures: the GPU a kernel sees, fusion's HBM round trips, FlashAttention's
tiles, split-KV decoding and its merge, the SMs a decode launch fills, and a CUDA graph's
timeline.

Sizes come from the specs (`minillm.lab.hardware`, `kernels.device`), bytes from a traced
run (`minillm.lab.op_trace`), tiles from the kernels' own tile choice, and split-KV's
partial results are computed, so each picture shows numbers the code produces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from minillm.lab.diagrams.canvas import Canvas
from minillm.lab.figures import PALETTE
from minillm.lab.hardware import DeviceSpec
from minillm.lab.units import TB, GiB, KiB

_INVISIBLE = "#ffffff"  # a box drawn only for its label


def _caption(c: Canvas, x: float, y: float, w: float, h: float, text: str, size=10) -> None:
    """Text centred in (x, y, w, h) that `labels()` reads back."""
    c.box(x, y, w, h, text, kind=_INVISIBLE, fill=0, fontsize=size)


def draw_gpu_anatomy(spec: DeviceSpec, arch) -> Canvas:
    """One SM enlarged (warps, registers, shared memory / L1, tensor cores), the grid of all
    the GPU's SMs, the L2 they share and the HBM behind it.

    `spec` is a `DeviceSpec`, `arch` the `kernels.device.ArchLimits` of its compute
    capability."""
    c = Canvas(20, 12)
    # the enlarged SM
    c.box(0.3, 3.4, 10.4, 8.3, kind="compute", fill=0.9)
    _caption(c, 0.4, 10.8, 10.2, 0.8, "one SM (streaming multiprocessor)", size=11)
    warps = arch.max_warps_per_sm
    per_row = 16
    size = 9.6 / per_row
    for i in range(warps):
        row, col = divmod(i, per_row)
        c.box(
            0.7 + col * size,
            10.2 - (row + 1) * 0.5,
            size - 0.08,
            0.42,
            kind="request",
            fill=0.45,
            rounded=False,
        )
    rows_of_warps = math.ceil(warps / per_row)
    y_warps = 10.2 - rows_of_warps * 0.5
    _caption(c, 0.4, y_warps - 0.75, 10.2, 0.7, f"up to {warps} resident warps of 32 threads")
    registers_kib = arch.registers_per_sm * 4 / KiB
    c.box(
        0.7,
        5.9,
        4.7,
        1.5,
        f"registers\n{arch.registers_per_sm // 1024}K x 32 bit = {registers_kib:.0f} KiB",
        kind="request",
        fill=0.7,
        fontsize=10,
    )
    c.box(5.6, 5.9, 4.7, 1.5, "tensor cores\n(tl.dot)", kind="compute", fill=0.5, fontsize=10)
    c.box(
        0.7,
        3.8,
        9.6,
        1.6,
        f"shared memory / L1: {arch.shared_memory_per_sm / KiB:.0f} KiB"
        f"\n(at most {arch.shared_memory_per_program / KiB:.0f} KiB for one program)",
        kind="memory",
        fill=0.6,
        fontsize=10,
    )
    # all the SMs, one square each
    n = spec.num_compute_units
    cols = 12
    rows = math.ceil(n / cols)
    cell = min(8.4 / cols, 6.6 / rows)
    for i in range(n):
        row, col = divmod(i, cols)
        c.box(
            11.3 + col * cell,
            10.9 - (row + 1) * cell,
            cell * 0.85,
            cell * 0.85,
            kind="compute",
            fill=0.9 if i else 0.2,
            rounded=False,
        )
    _caption(c, 11.2, 10.9, 8.6, 0.8, f"{n} {spec.compute_unit}s", size=11)
    c.arrow((11.3 + cell * 0.4, 10.9 - cell * 0.5), (10.7, 9.5), dashed=True, kind="muted")
    c.box(
        0.3,
        1.9,
        19.4,
        1.0,
        f"L2 cache, shared by all {n} {spec.compute_unit}s",
        kind="host",
        fill=0.75,
        fontsize=10,
    )
    c.box(
        0.3,
        0.2,
        19.4,
        1.2,
        f"{spec.memory_type}: {spec.memory_bytes / GiB:.0f} GiB at "
        f"{spec.memory_bandwidth_bytes_per_s / TB:.2f} TB/s",
        kind="memory",
        fill=0.35,
        fontsize=11,
    )
    c.arrow((5.5, 3.4), (5.5, 2.9), both=True)
    c.arrow((15.5, 10.9 - rows * cell - 0.1), (15.5, 2.9), both=True)
    c.arrow((10.0, 1.9), (10.0, 1.4), both=True)
    return c


def _op_label(name: str) -> str:
    """`add.Tensor` -> `add`, `_to_copy.default` -> `to_copy`."""
    return name.split(".")[0].lstrip("_")


def draw_fusion(ops: Sequence, fused_bytes: int, fused_name: str = "rms_norm kernel") -> Canvas:
    """Eager operations, each a round trip to HBM (MB read, MB written), above the fused
    kernel that reads and writes once. `ops` are `minillm.lab.op_trace.OpRecord`s."""
    n = len(ops)
    c = Canvas(20, 10)
    width = 19.4 / n
    eager_mb = sum(op.bytes_read + op.bytes_written for op in ops) / 1e6
    _caption(c, 0.3, 9.1, 19.4, 0.8, f"eager: {n} kernels, {eager_mb:,.0f} MB through HBM", size=11)
    c.box(0.3, 5.0, 19.4, 0.8, "HBM", kind="memory", fill=0.35, fontsize=10)
    for i, op in enumerate(ops):
        x = 0.3 + i * width
        box = c.box(
            x + 0.05,
            7.2,
            width - 0.1,
            1.6,
            f"{_op_label(op.name)}\nr {op.bytes_read / 1e6:.0f}\nw {op.bytes_written / 1e6:.0f}",
            kind="compute",
            fill=0.6,
            fontsize=9,
        )
        c.arrow((x + width * 0.3, 5.8), (x + width * 0.3, box[1]))
        c.arrow((x + width * 0.7, box[1]), (x + width * 0.7, 5.8), kind="accent")
    _caption(
        c,
        0.3,
        3.6,
        19.4,
        0.8,
        f"fused: 1 kernel, {fused_bytes / 1e6:,.0f} MB through "
        f"HBM ({eager_mb * 1e6 / fused_bytes:.1f}x less)",
        size=11,
    )
    kernel = c.box(
        4.0,
        1.9,
        12.0,
        1.5,
        f"{fused_name}: every step in registers",
        kind="compute",
        fill=0.6,
        fontsize=10,
    )
    c.box(0.3, 0.2, 19.4, 0.8, "HBM", kind="memory", fill=0.35, fontsize=10)
    c.arrow((7.0, 1.0), (7.0, kernel[1]), "read once", label_offset=(-1.2, 0.0))
    c.arrow((13.0, kernel[1]), (13.0, 1.0), "written once", kind="accent", label_offset=(1.4, 0.0))
    return c


def tile_states(num_queries: int, num_keys: int, block_m: int, block_n: int) -> list[list[str]]:
    """Causal attention's tiles: [q block][k block] -> "full" (no mask needed), "diagonal"
    (masked) or "skipped" (every key is after every query of the block)."""
    states = []
    for i in range(math.ceil(num_queries / block_m)):
        q_first, q_last = i * block_m, min((i + 1) * block_m, num_queries) - 1
        row = []
        for j in range(math.ceil(num_keys / block_n)):
            k_first, k_last = j * block_n, min((j + 1) * block_n, num_keys) - 1
            if k_first > q_last:
                row.append("skipped")
            elif k_last <= q_first:
                row.append("full")
            else:
                row.append("diagonal")
        states.append(row)
    return states


_TILE_KIND = {"full": ("compute", 0.45), "diagonal": ("accent", 0.55), "skipped": ("free", 0.6)}


def draw_flash_tiling(num_tokens: int, block_m: int, block_n: int) -> Canvas:
    """The causal score matrix of one head, cut into BLOCK_M x BLOCK_N tiles: each row of
    tiles is one program (its Q block), which walks the K/V blocks left to right."""
    states = tile_states(num_tokens, num_tokens, block_m, block_n)
    rows, cols = len(states), len(states[0])
    c = Canvas(20, 11)
    cell_w = 13.0 / cols
    cell_h = min(8.0 / rows, cell_w * block_m / block_n)
    x0, top = 4.6, 9.4
    for i, row in enumerate(states):
        y = top - (i + 1) * cell_h
        _caption(
            c,
            0.1,
            y,
            4.3,
            cell_h,
            f"program {i}: queries\n{i * block_m}-{min((i + 1) * block_m, num_tokens) - 1}",
            size=9.5,
        )
        for j, state in enumerate(row):
            kind, fill = _TILE_KIND[state]
            c.box(
                x0 + j * cell_w + 0.04,
                y + 0.04,
                cell_w - 0.08,
                cell_h - 0.08,
                kind=kind,
                fill=fill,
                rounded=False,
            )
    _caption(c, x0, top + 0.1, 13.0, 0.7, f"K/V blocks of {block_n} keys: the inner loop", size=10)
    c.arrow((x0, top + 0.95), (x0 + 13.0, top + 0.95))
    counts = {s: sum(row.count(s) for row in states) for s in _TILE_KIND}
    legend = (
        ("full", f"computed, no mask: {counts['full']}"),
        ("diagonal", f"on the diagonal, masked: {counts['diagonal']}"),
        ("skipped", f"skipped (causal): {counts['skipped']}"),
    )
    for k, (state, text) in enumerate(legend):
        kind, fill = _TILE_KIND[state]
        x = 0.3 + k * 6.6
        c.box(x, 0.25, 0.6, 0.6, kind=kind, fill=fill, rounded=False)
        _caption(c, x + 0.7, 0.15, 5.8, 0.8, text, size=10)
    _caption(
        c,
        17.7,
        2.2,
        2.3,
        5.0,
        f"{block_m} query\nrows per\nprogram,\n{block_n} keys\nper tile",
        size=9.5,
    )
    return c


def split_ranges(seq_len: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """The key ranges [start, end) of the decode kernel's splits: each split takes
    cdiv(cdiv(seq_len, num_splits), block_n) * block_n keys; a split past the end is empty."""
    per_split = math.ceil(math.ceil(seq_len / num_splits) / block_n) * block_n
    return [
        (min(s * per_split, seq_len), min((s + 1) * per_split, seq_len)) for s in range(num_splits)
    ]


def split_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges, scale: float):
    """Each split's normalized output and log-sum-exp, and their merge.

    q: [head_dim], k and v: [seq_len, head_dim]. Returns (outputs [splits, head_dim], lse
    [splits], weights [splits], merged [head_dim])."""
    outs, lses = [], []
    for start, end in ranges:
        if start == end:
            outs.append(torch.zeros_like(q))
            lses.append(torch.tensor(float("-inf"), dtype=q.dtype))
            continue
        s = (k[start:end] @ q) * scale
        lse = torch.logsumexp(s, 0)
        outs.append(torch.exp(s - lse) @ v[start:end])
        lses.append(lse)
    out, lse = torch.stack(outs), torch.stack(lses)
    weights = torch.exp(lse - lse.max())
    weights = weights / weights.sum()
    return out, lse, weights, weights @ out


def draw_split_kv(seq_len: int, num_splits: int, block_n: int, seed: int = 0) -> Canvas:
    """One sequence's context cut into the kernel's split ranges; each split's program
    returns (o_i, lse_i), and the merge weighs them by exp(lse_i - max lse). The lse values
    and weights are computed on random q, k, v (head_dim 64)."""
    ranges = split_ranges(seq_len, num_splits, block_n)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(64, generator=g, dtype=torch.float64)
    k = torch.randn(seq_len, 64, generator=g, dtype=torch.float64)
    v = torch.randn(seq_len, 64, generator=g, dtype=torch.float64)
    _, lse, weights, _ = split_partials(q, k, v, ranges, 64**-0.5)
    c = Canvas(20, 9)
    _caption(
        c,
        0.3,
        8.1,
        19.4,
        0.8,
        f"one sequence's context: {seq_len:,} keys in the paged cache, {num_splits} splits",
        size=11,
    )
    width = 19.4 / num_splits
    merge = c.box(
        5.5, 0.3, 9.0, 1.5, "merge: o = sum w_i o_i / sum w_i", kind="accent", fill=0.7, fontsize=10
    )
    for s, ((start, end), l_s, w) in enumerate(
        zip(ranges, lse.tolist(), weights.tolist(), strict=True)
    ):
        x = 0.3 + s * width
        span = f"keys {start}-{end - 1}" if end > start else "empty"
        keys = c.box(x + 0.05, 6.6, width - 0.1, 1.2, span, kind="memory", fill=0.45, fontsize=10)
        part = c.box(
            x + 0.15,
            3.2,
            width - 0.3,
            2.4,
            f"program {s}\no_{s}, lse_{s} = {l_s:.2f}\nw_{s} = {w:.2f}",
            kind="compute",
            fill=0.6,
            fontsize=10,
        )
        c.arrow(keys, part, sides=("bottom", "top"))
        c.arrow(part, merge, sides=("bottom", "top"))
    return c


def draw_sm_fill(num_programs: Sequence[int], titles: Sequence[str], num_sms: int) -> Canvas:
    """Side by side, the GPU's SMs for each launch of `num_programs` programs, placed one
    per SM, then two per SM: an SM with work is coloured, an idle one grey."""
    panels = len(num_programs)
    c = Canvas(20, 9.2)
    cols = 12
    rows = math.ceil(num_sms / cols)
    panel_w = 19.4 / panels
    cell = min((panel_w - 0.8) / cols, 7.0 / rows)
    for p, (programs, title) in enumerate(zip(num_programs, titles, strict=True)):
        x0 = 0.3 + p * panel_w + (panel_w - cols * cell) / 2
        busy = min(programs, num_sms)
        for i in range(num_sms):
            row, col = divmod(i, cols)
            work = programs // num_sms + (1 if i < programs % num_sms else 0)
            c.box(
                x0 + col * cell,
                7.6 - (row + 1) * cell,
                cell * 0.85,
                cell * 0.85,
                kind="compute" if work else "free",
                fill=0.15 if work > 1 else 0.5,
                rounded=False,
            )
        _caption(
            c,
            0.3 + p * panel_w,
            7.8,
            panel_w,
            1.2,
            f"{title}\n{programs} programs: {busy} of {num_sms} SMs busy",
            size=10,
        )
    return c


def cuda_graph_timeline(
    num_kernels: int, launch_us: float, kernel_us: float, graph_launch_us: float
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Start and end (µs) of each CPU launch and GPU kernel, eager and replayed as a graph.

    Eager: the CPU issues the kernels one after another; a kernel starts when it has been
    issued and the previous one is done. Graph: one launch, then the kernels back to back."""
    cpu, gpu, free_at = [], [], 0.0
    for i in range(num_kernels):
        cpu.append((i * launch_us, (i + 1) * launch_us))
        start = max((i + 1) * launch_us, free_at)
        gpu.append((start, start + kernel_us))
        free_at = start + kernel_us
    graph_gpu = [
        (graph_launch_us + i * kernel_us, graph_launch_us + (i + 1) * kernel_us)
        for i in range(num_kernels)
    ]
    return {
        "eager": {"cpu": cpu, "gpu": gpu},
        "graph": {"cpu": [(0.0, graph_launch_us)], "gpu": graph_gpu},
    }


def draw_cuda_graph(
    num_kernels: int = 8,
    launch_us: float = 5.0,
    kernel_us: float = 2.0,
    graph_launch_us: float = 8.0,
) -> Canvas:
    """CPU launches and GPU kernels on one time axis, eager above and CUDA graph below."""
    timeline = cuda_graph_timeline(num_kernels, launch_us, kernel_us, graph_launch_us)
    end_us = max(e for mode in timeline.values() for spans in mode.values() for _, e in spans)
    c = Canvas(20, 8)
    x0, span_w = 2.6, 17.0
    scale = span_w / end_us
    for m, (mode, lanes) in enumerate(timeline.items()):
        base = 5.0 - 4.2 * m
        gpu_end = lanes["gpu"][-1][1]
        busy = num_kernels * kernel_us
        _caption(
            c,
            x0,
            base + 2.3,
            span_w,
            0.7,
            f"{mode}: {len(lanes['cpu'])} launch"
            f"{'es' if len(lanes['cpu']) > 1 else ''}, step done at {gpu_end:.0f} µs, "
            f"GPU busy {busy:.0f} of them",
            size=10,
        )
        for lane, y, kind in (("cpu", base + 1.2, "host"), ("gpu", base, "compute")):
            c.text(x0 - 0.2, y + 0.45, lane.upper(), ha="right", size=10)
            c.box(x0, y, gpu_end * scale, 0.9, kind="free", fill=0.7, rounded=False)
            for start, end in lanes[lane]:
                c.box(
                    x0 + start * scale + 0.02,
                    y,
                    (end - start) * scale - 0.04,
                    0.9,
                    kind=kind,
                    fill=0.3,
                    rounded=False,
                )
    for t in range(0, int(end_us) + 1, 10):
        c.text(x0 + t * scale, 0.15, f"{t}", size=9, color=PALETTE["muted"])
    c.text(x0 - 0.2, 0.15, "µs", ha="right", size=9, color=PALETTE["muted"])
    return c


__all__ = [
    "cuda_graph_timeline",
    "draw_cuda_graph",
    "draw_flash_tiling",
    "draw_fusion",
    "draw_gpu_anatomy",
    "draw_sm_fill",
    "draw_split_kv",
    "split_partials",
    "split_ranges",
    "tile_states",
]


def draw_cascade(suffix_lens: Sequence[int], prefix_len: int) -> Canvas:
    """Decode attention for requests that share a prefix, without and with cascade attention.

    Left, each request's program walks its whole context, so the shared prefix's keys and
    values are read once per request; right, one pass attends every query to the prefix
    (read once) and one pass per request attends to its own suffix, and the split-KV merge
    combines the two. Bar widths are to scale in tokens."""
    if not suffix_lens or prefix_len < 1 or min(suffix_lens) < 1:
        raise ValueError("need a prefix and at least one request with a suffix of >= 1 token")
    n = len(suffix_lens)
    row = 1.1
    height = 2.6 + n * row
    c = Canvas(22, height)
    unit = 6.4 / (prefix_len + max(suffix_lens))  # units per token, the same in both panels
    prefix_w = prefix_len * unit
    top = height - 1.6
    for x0, title in (
        (0.2, f"without cascade: the prefix is read {n} times"),
        (11.4, "with cascade: the prefix is read once"),
    ):
        c.text(x0 + 5.1, height - 0.6, title, size=11)
        for i, suffix in enumerate(suffix_lens):
            y = top - (i + 1) * row
            c.text(x0 + 0.5, y + row * 0.4, f"q{i}", size=10)
            if x0 < 1:  # without cascade: every row carries its own copy of the prefix read
                c.box(x0 + 1.1, y, prefix_w, row * 0.8, kind="compute", fill=0.35)
            c.box(x0 + 1.25 + prefix_w, y, max(suffix * unit, 0.2), row * 0.8, kind="request")
        if x0 > 1:  # with cascade: one tile of the prefix for every query, then a merge
            c.box(
                x0 + 1.1,
                top - n * row,
                prefix_w,
                n * row - row * 0.2,
                "shared prefix:\none pass, all queries",
                kind="compute",
                fill=0.35,
                fontsize=10,
            )
            c.text(x0 + 8.6, top - n * row / 2, "merge\n(o, lse)\nper\nrequest", size=10)
        c.text(x0 + 1.1 + prefix_w / 2, 0.55, f"{prefix_len:,} prefix tokens", size=10)
        c.text(x0 + 1.3 + prefix_w + 1.2, 0.55, "own suffix", size=10, color=PALETTE["request"])
    return c
