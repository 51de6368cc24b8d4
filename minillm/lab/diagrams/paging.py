"""Chapter 3's diagrams: what a token caches, and how the engine pages, shares and finds it.

Every drawing reads a real object: head counts from a model's configuration, block ids,
reference counts and the free list from a `BlockPool`, chained hashes from a
`KVCacheManager`, nodes from a `RadixCache`. A diagram is a `PartsCanvas`, a `Canvas` that
also remembers which part of the picture each box belongs to (`parts`) and which boxes a
line joins (`links`), so a test can read back what was drawn and compare it with the
engine's state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from minillm.core.block_pool import BlockPool
from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.radix_cache import RadixCache, RadixNode
from minillm.lab import kv_memory
from minillm.lab.catalog import get_model_config
from minillm.lab.diagrams.canvas import Canvas, color
from minillm.lab.figures import FONT_SIZE, PALETTE
from minillm.lab.units import KiB


class PartsCanvas(Canvas):
    """A `Canvas` that records, for each box, the part of the diagram it belongs to."""

    def __init__(self, width: float, height: float, inches: float | None = None):
        super().__init__(width, height, inches)
        self._parts: list[tuple[str, str]] = []
        self.links: list[tuple[str, str]] = []  # (from, to) names of the boxes a line joins

    def part_box(self, part: str, name: str, x, y, w, h, label: str = "", **kw):
        """A box of `part`, known to tests as `name` (its label when it has one)."""
        box = self.box(x, y, w, h, label, **kw)
        self._parts.append((part, name))
        return box

    def parts(self, part: str) -> list[str]:
        """The names of the boxes drawn in `part`, in the order they were drawn."""
        return [name for p, name in self._parts if p == part]

    def line(self, a: tuple[float, float], b: tuple[float, float], names=None, **kw) -> None:
        """A plain line from point a to point b (many of them read better than arrows)."""
        kw.setdefault("color", PALETTE["muted"])
        kw.setdefault("linewidth", 0.8)
        self.ax.plot([a[0], b[0]], [a[1], b[1]], **kw)
        if names is not None:
            self.links.append(names)


# -- what one token caches: MHA, GQA, MQA, MLA ----------------------------------------------


@dataclass(frozen=True, slots=True)
class HeadSharing:
    """One attention variant of one model: which query heads read which cached heads."""

    attention: str  # "MHA" | "GQA" | "MQA" | "MLA"
    model: str
    num_query_heads: int
    num_kv_heads: int  # 0 for MLA, which caches no heads
    bytes_per_token: int  # bf16, all layers
    kv_lora_rank: int = 0  # MLA: the latent's size
    qk_rope_head_dim: int = 0  # MLA: the shared RoPE key's size


def head_sharing_variants(model: str = "Llama 3.1 8B") -> list[HeadSharing]:
    """MHA, GQA and MQA with a catalog model's query heads, and DeepSeek V3's MLA.

    The GQA row is the model as it ships; the MHA and MQA rows give it one KV head per query
    head and one KV head in all. Head counts and sizes come from the configurations, the
    bytes per token from `kv_memory`.
    """
    config = get_model_config(model)
    layers, heads, head_dim = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    rows = []
    for kv_heads, label in (
        (heads, f"{model} as MHA"),
        (config.num_key_value_heads, model),
        (1, f"{model} as MQA"),
    ):
        layout = kv_memory.gqa_layout(label, layers, heads, kv_heads, head_dim)
        rows.append(
            HeadSharing(
                layout.attention, label, heads, kv_heads, kv_memory.kv_bytes_per_token(layout)
            )
        )
    ds = kv_memory.DEEPSEEK_V3_CONFIG
    mla = kv_memory.get_kv_layout("DeepSeek V3")
    rows.append(
        HeadSharing(
            "MLA",
            "DeepSeek V3",
            ds["num_attention_heads"],
            0,
            kv_memory.kv_bytes_per_token(mla),
            ds["kv_lora_rank"],
            ds["qk_rope_head_dim"],
        )
    )
    return rows


def kib_label(num_bytes: float) -> str:
    """Bytes per token as the head-sharing diagram writes them."""
    kib = num_bytes / KiB
    return (f"{kib:,.0f}" if kib == int(kib) else f"{kib:,.1f}") + " KiB\nper token"


def draw_head_sharing(rows: Sequence[HeadSharing]) -> PartsCanvas:
    """Query heads (top of each row) and what the cache keeps for them (bottom), one row per
    variant, with the bytes per token on the right. Parts: `query:<attention>`,
    `cached:<attention>` and `bytes:<attention>`; links join query head i to its KV head."""
    row_h, width = 3.2, 27.0
    canvas = PartsCanvas(width, row_h * len(rows) + 0.4)
    x0, strip = 5.6, 16.0  # the heads' strip
    for r, row in enumerate(rows):
        y = canvas.height - (r + 1) * row_h
        canvas.text(0.2, y + 2.0, row.attention, ha="left", size=FONT_SIZE + 1, weight="bold")
        canvas.text(0.2, y + 1.1, _wrap(row.model, 18), ha="left", size=FONT_SIZE - 1)
        pitch = strip / row.num_query_heads
        q_w = pitch * 0.8
        q_y, kv_y, h = y + 2.0, y + 0.35, 0.6
        query_centres = []
        for i in range(row.num_query_heads):
            qx = x0 + i * pitch
            canvas.part_box(
                f"query:{row.attention}", f"q{i}", qx, q_y, q_w, h, kind="compute", rounded=False
            )
            query_centres.append(qx + q_w / 2)
        canvas.text(
            x0 + strip + 0.2,
            q_y + h / 2,
            f"{row.num_query_heads} query\nheads",
            ha="left",
            size=FONT_SIZE - 2,
            color=PALETTE["muted"],
        )
        if row.attention == "MLA":
            rope_w = strip * row.qk_rope_head_dim / (row.kv_lora_rank + row.qk_rope_head_dim)
            lat_w = strip - rope_w - 0.3
            latent = canvas.part_box(
                f"cached:{row.attention}",
                "latent",
                x0,
                kv_y,
                lat_w,
                h + 0.3,
                f"latent c_KV: {row.kv_lora_rank}",
                kind="memory",
                fontsize=FONT_SIZE - 1,
            )
            canvas.part_box(
                f"cached:{row.attention}",
                "rope key",
                x0 + lat_w + 0.3,
                kv_y,
                rope_w,
                h + 0.3,
                f"RoPE\nkey: {row.qk_rope_head_dim}",
                kind="memory",
                fontsize=FONT_SIZE - 2,
            )
            for i, cx in enumerate(query_centres):
                if i % 8 == 0 or i == row.num_query_heads - 1:
                    target = (latent[0] + lat_w * (i + 0.5) / row.num_query_heads, kv_y + h + 0.3)
                    canvas.line((cx, q_y), target, ("q" + str(i), "latent"), linestyle=":")
            canvas.text(
                x0 + lat_w / 2,
                (q_y + kv_y + h + 0.3) / 2 + 0.05,
                "every head's K and V are rebuilt from the latent",
                size=FONT_SIZE - 2,
                color=PALETTE["muted"],
                bbox=dict(facecolor="white", edgecolor="none", pad=1),
            )
        else:
            group = row.num_query_heads // row.num_kv_heads
            for j in range(row.num_kv_heads):
                first, last = query_centres[j * group], query_centres[(j + 1) * group - 1]
                kv_w = max(min(q_w, 0.9), last - first + q_w * (0.6 if group > 1 else 0.0))
                kv_w = min(kv_w, 5.5)  # one KV head (MQA) is one head, not a wide one
                kx = (first + last) / 2 - kv_w / 2
                label = "one K and V head" if row.num_kv_heads == 1 else ""
                canvas.part_box(
                    f"cached:{row.attention}",
                    f"kv{j}",
                    kx,
                    kv_y,
                    kv_w,
                    h,
                    label,
                    kind="memory",
                    rounded=False,
                    fontsize=FONT_SIZE - 1,
                )
                for i in range(j * group, (j + 1) * group):
                    canvas.line(
                        (query_centres[i], q_y), ((first + last) / 2, kv_y + h), (f"q{i}", f"kv{j}")
                    )
            canvas.text(
                x0 + strip + 0.2,
                kv_y + h / 2,
                f"{row.num_kv_heads} KV\nhead" + ("s" if row.num_kv_heads > 1 else ""),
                ha="left",
                size=FONT_SIZE - 2,
                color=PALETTE["muted"],
            )
        canvas.part_box(
            f"bytes:{row.attention}",
            kib_label(row.bytes_per_token),
            width - 3.4,
            y + 0.8,
            3.2,
            1.6,
            kib_label(row.bytes_per_token),
            kind="accent",
            fill=0.85,
            fontsize=FONT_SIZE - 1,
        )
    return canvas


def _wrap(text: str, width: int) -> str:
    """`text` broken at spaces into lines of at most about `width` characters."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])


# -- the paged KV cache: block tables over a block pool -------------------------------------


def block_label(block_id: int, ref_cnt: int) -> str:
    """A physical block as the pool diagram labels it."""
    return f"{block_id}\nref {ref_cnt}"


def draw_block_pool(
    pool: BlockPool,
    tables: Mapping[str, Sequence[int]],
    num_tokens: Mapping[str, int] | None = None,
    block_size: int = 16,
    per_row: int = 8,
) -> PartsCanvas:
    """Each request's logical blocks, its block table, and the physical blocks of `pool`.

    `tables` maps a request to its block ids (`KVCacheManager.get_block_ids`); `num_tokens`,
    when given, shades how full each request's last block is. A physical block shows its id
    and reference count; a block two tables share is drawn in the accent colour, a free
    block grey (dashed when it still holds a cached prefix). The free list runs along the
    bottom from head (reused first) to tail. Parts: `logical:<req>`, `table:<req>`,
    `physical` (labels `block_label(id, ref_cnt)`, every block in id order), `owners`
    ("id: A0 C0", the table entries that point to a block) and `free list`.
    """
    if pool.num_blocks > 4 * per_row:
        raise ValueError(
            f"a pool of {pool.num_blocks} blocks is too large to draw; use <= {4 * per_row}"
        )
    owners: dict[int, list[str]] = {}
    for req, table in tables.items():
        for i, block_id in enumerate(table):
            owners.setdefault(block_id, []).append(f"{req}{i}" if len(req) == 1 else f"{req}.{i}")
    # the owners of a block are written under it, two to a line
    tag_lines = max([-(-len(o) // 2) for o in owners.values()], default=1)
    num_rows = -(-pool.num_blocks // per_row)
    req_h, cell_h, base = 1.6, 1.5, 2.6
    row_pitch = 1.8 + 0.5 * tag_lines
    area_h = max(len(tables) * req_h, num_rows * row_pitch)
    width = 30.0
    canvas = PartsCanvas(width, base + area_h + 1.0)
    top = canvas.height - 1.0  # the top of the drawing area, under the headings
    px0, pitch = 15.2, 1.85
    for x, heading in (
        (3.0, "logical blocks"),
        (10.4, "block table"),
        (px0 + per_row * pitch / 2, "physical blocks of the pool"),
    ):
        canvas.text(x, top + 0.5, heading, size=FONT_SIZE - 1, color=PALETTE["muted"])
    # the pool first: where every table entry points
    pos = {}
    for block in pool.blocks:
        row, col = divmod(block.block_id, per_row)
        x, y = px0 + col * pitch, top - (row + 1) * row_pitch + 0.6
        if block.ref_cnt > 1:
            kind, fill, dashed = "accent", 0.7, False
        elif block.ref_cnt == 1:
            kind, fill, dashed = "memory", 0.6, False
        else:
            kind, fill, dashed = "muted", 0.85, block.block_hash is not None
        label = block_label(block.block_id, block.ref_cnt)
        pos[block.block_id] = canvas.part_box(
            "physical",
            label,
            x,
            y,
            1.6,
            cell_h,
            label,
            kind=kind,
            fill=fill,
            dashed=dashed,
            fontsize=FONT_SIZE - 1,
        )
        if block.block_id in owners:  # which table entries point here: A1 is A's block 1
            tags = owners[block.block_id]
            lines = [" ".join(tags[k : k + 2]) for k in range(0, len(tags), 2)]
            canvas.text(
                x + 0.8,
                y - 0.1,
                "\n".join(lines),
                size=FONT_SIZE - 2,
                color=color("request"),
                va="top",
            )
            tags = " ".join(tags)
            canvas._parts.append(("owners", f"{block.block_id}: {tags}"))
    for r, (req, table) in enumerate(tables.items()):
        y = top - (r + 1) * req_h + 0.3
        canvas.text(0.1, y + 0.6, str(req), ha="left", size=FONT_SIZE, weight="bold")
        if len(table) > 6:
            raise ValueError(f"request {req!r} holds {len(table)} blocks; draw at most 6")
        for i, block_id in enumerate(table):
            x = 1.2 + i * 1.2
            canvas.part_box(
                f"logical:{req}",
                str(i),
                x,
                y,
                1.05,
                1.2,
                str(i),
                kind="request",
                rounded=False,
                fill=0.75,
                fontsize=FONT_SIZE - 1,
            )
            if num_tokens is not None and i == len(table) - 1:
                used = num_tokens[req] - block_size * (len(table) - 1)
                canvas.ax.add_patch(_bar(x, y, 1.05 * used / block_size, 0.18, "request"))
            tx = 9.0 + i * 0.95
            canvas.part_box(
                f"table:{req}",
                str(block_id),
                tx,
                y + 0.1,
                0.9,
                1.0,
                str(block_id),
                kind="host",
                rounded=False,
                fill=0.8,
                fontsize=FONT_SIZE - 1,
            )
        canvas.arrow((1.2 + len(table) * 1.2, y + 0.6), (8.9, y + 0.6), kind="muted")
    # the free list, head to tail
    free_ids = list(pool.free_block_queue)
    canvas.text(0.1, 1.3, "free list", ha="left", size=FONT_SIZE, weight="bold")
    canvas.text(
        2.9, 0.3, "head: reused first", ha="left", size=FONT_SIZE - 2, color=PALETTE["muted"]
    )
    fx = 2.9
    for k, block_id in enumerate(free_ids):
        b = canvas.part_box(
            "free list",
            str(block_id),
            fx + k * 1.5,
            0.85,
            1.0,
            0.9,
            str(block_id),
            kind="muted",
            fill=0.85,
            fontsize=FONT_SIZE - 1,
            dashed=pool.blocks[block_id].block_hash is not None,
        )
        if k:
            canvas.arrow((b[0] - 0.5, 1.3), (b[0], 1.3))
    if not free_ids:
        canvas.text(fx, 1.3, "(empty)", ha="left", color=PALETTE["muted"])
    canvas.text(
        width - 0.1,
        0.3,
        "A1: request A's logical block 1 · grey: free · dashed: free, still cached · red: shared",
        ha="right",
        size=FONT_SIZE - 2,
        color=PALETTE["muted"],
    )
    return canvas


def _bar(x, y, w, h, kind):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=color(kind), edgecolor="none")


# -- prefix caching: chained block hashes -----------------------------------------------------


def short_hash(block_hash: int) -> str:
    """The first 6 hex digits of a 256-bit block hash, as the diagram prints it."""
    return f"{block_hash:064x}"[:6]


def draw_block_hashes(
    manager: KVCacheManager,
    request_ids: Sequence[str],
    block_text: Mapping[str, Sequence[str]] | None = None,
) -> PartsCanvas:
    """The chain of each request's full-block hashes, as the manager computed them.

    Block i's box shows its physical block id and its hash; the arrow into it is the parent
    hash it was computed with. Blocks whose hash is also another drawn request's (a hit) are
    drawn in the accent colour. `block_text` adds each block's text above it. Parts:
    `hash:<req>` (`short_hash` of each hash) and `block:<req>` (block ids).
    """
    hashes = {r: manager.req_to_block_hashes[r] for r in request_ids}
    tables = {r: manager.get_block_ids(r) for r in request_ids}
    num = max(len(h) for h in hashes.values())
    row_h, cell_w = 2.9, 4.4
    width = 3.0 + num * (cell_w + 0.9)
    canvas = PartsCanvas(width, row_h * len(request_ids) + 0.3)
    counts: dict[int, int] = {}
    for h in hashes.values():
        for value in h:
            counts[value] = counts.get(value, 0) + 1
    for r, req in enumerate(request_ids):
        y = canvas.height - (r + 1) * row_h
        canvas.text(0.1, y + 0.9, str(req), ha="left", size=FONT_SIZE, weight="bold")
        prev = None
        for i, value in enumerate(hashes[req]):
            x = 3.0 + i * (cell_w + 0.9)
            shared = counts[value] > 1
            label = f"block {tables[req][i]}\n{short_hash(value)}…"
            box = canvas.part_box(
                f"hash:{req}",
                short_hash(value),
                x,
                y + 0.2,
                cell_w,
                1.4,
                label,
                kind="accent" if shared else "memory",
                fill=0.75 if shared else 0.65,
                fontsize=FONT_SIZE - 1,
            )
            canvas._parts.append((f"block:{req}", str(tables[req][i])))
            if block_text is not None:
                canvas.text(
                    x + cell_w / 2,
                    y + 2.0,
                    block_text[req][i],
                    size=FONT_SIZE - 2,
                    color=PALETTE["ink"],
                    family="monospace",
                )
            if prev is None:
                canvas.arrow((x - 1.6, y + 0.9), box, "", sides=("", "left"))
                canvas.text(x - 1.9, y + 0.9, "∅", size=FONT_SIZE, color=PALETTE["muted"])
            else:
                canvas.arrow(prev, box, "", sides=("right", "left"))
            prev = box
    return canvas


# -- the radix tree -----------------------------------------------------------------------------


def radix_node_label(node: RadixNode, text: Callable[[tuple[int, ...]], str] | None) -> str:
    """A node of the tree as the radix diagram labels it: its span, size and blocks."""
    lines = []
    if text is not None:
        lines.append(text(node.key))
    lines.append(f"{len(node.key)} token" + ("s" if len(node.key) != 1 else ""))
    if node.value:
        ids = [getattr(v, "block_id", v) for v in node.value]
        lines.append("blocks " + ",".join(str(i) for i in ids))
    return "\n".join(lines)


def draw_radix_tree(
    cache: RadixCache,
    text: Callable[[tuple[int, ...]], str] | None = None,
    leaf_width: float = 3.6,
) -> PartsCanvas:
    """Every node of `cache`, root at the top, children left to right by first token.

    A node's box shows `text(span)` when given, its token count, and, on the engine's paged
    tree, the ids of the blocks that hold it. Parts: `node` (labels from `radix_node_label`,
    in depth-first order); links join each parent's label to its child's.
    """
    depth_of: dict[int, int] = {}
    leaves: list[RadixNode] = []
    order: list[RadixNode] = []

    def children(node: RadixNode) -> list[RadixNode]:
        return [node.children[k] for k in sorted(node.children)]

    def walk(node: RadixNode, depth: int) -> None:
        depth_of[id(node)] = depth
        order.append(node)
        kids = children(node)
        if not kids:
            leaves.append(node)
        for kid in kids:
            walk(kid, depth + 1)

    walk(cache.root, 0)
    max_depth = max(depth_of.values())
    level_h, box_h = 1.9, 1.35
    width = max(len(leaves) * leaf_width, 8.0)
    canvas = PartsCanvas(width, (max_depth + 1) * level_h + 0.2, min(7.8, 0.42 * width))
    xs: dict[int, float] = {}
    for k, leaf in enumerate(leaves):
        xs[id(leaf)] = (k + 0.5) * leaf_width
    for node in reversed(order):
        if id(node) not in xs:
            kids = children(node)
            xs[id(node)] = sum(xs[id(c)] for c in kids) / len(kids)
    boxes = {}
    labels = {}
    for node in order:
        depth = depth_of[id(node)]
        y = canvas.height - (depth + 1) * level_h + (level_h - box_h) / 2
        if node is cache.root:
            label, kind, w = "root", "muted", 2.0
        else:
            label = radix_node_label(node, text)
            kind = "memory" if node.children else "request"
            w = leaf_width - 0.3
        labels[id(node)] = label
        part = "root" if node is cache.root else "node"
        boxes[id(node)] = canvas.part_box(
            part,
            label,
            xs[id(node)] - w / 2,
            y,
            w,
            box_h,
            label,
            kind=kind,
            fill=0.75,
            fontsize=FONT_SIZE - 2,
        )
    for node in order:
        for kid in children(node):
            a, b = boxes[id(node)], boxes[id(kid)]
            canvas.line(
                (a[0] + a[2] / 2, a[1]),
                (b[0] + b[2] / 2, b[1] + b[3]),
                (labels[id(node)], labels[id(kid)]),
                color=PALETTE["ink"],
                linewidth=1.0,
            )
    return canvas


__all__ = [
    "HeadSharing",
    "PartsCanvas",
    "block_label",
    "draw_block_hashes",
    "draw_block_pool",
    "draw_head_sharing",
    "draw_radix_tree",
    "head_sharing_variants",
    "kib_label",
    "radix_node_label",
    "short_hash",
]
