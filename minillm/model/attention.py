"""Paged attention: batch metadata, the KV-cache write, and the attention backends.

The KV cache of one layer is one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values). A sequence's tokens live in the blocks its block table lists, in
order, so its token t sits in slot `block_table[t // block_size] * block_size + t % block_size`
(PagedAttention: Kwon et al., 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention").

A backend turns (q, k, v, kv_cache_layer, meta) into the attention output of a flat batch.
The model picks one by name; `torch` is the reference, written to be read, not to be fast.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from minillm.model.kv_cache_dtype import calibrated_scales, is_fp8, quantize_kv, read_kv


@dataclass(slots=True)
class AttentionMetadata:
    """A flat batch: the new tokens of num_seqs sequences packed back to back."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cu_seqlens of the new (query) tokens
    seq_lens: torch.Tensor  # [num_seqs] int32: context length of each seq INCLUDING its new tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # a mixed batch (decode tokens beside prefill chunks): which rows are which, built on the
    # host with the rest of the metadata (`split_mixed_batch`); None otherwise
    mixed: MixedBatchSplit | None = None
    # the torch backend's view of the batch, the same in every layer: built once per step
    # (`plan_torch_attention`); when None, the torch backend's first layer derives it from the
    # tensors above and stores it here for the others
    torch_plan: TorchAttentionPlan | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(slots=True)
class MixedBatchSplit:
    """The decode rows and the prefill rows of a mixed batch, so that a backend can give each
    its own kernel: one query row per sequence with a long context suits split-KV decoding,
    a chunk of many rows suits a tiled prefill kernel.

    A sequence with exactly one new token is a decode row (the last, one-token chunk of a
    chunked prefill is one too: its attention is the same computation).
    """

    decode_seqs: torch.Tensor  # [num_decodes] int64: the decode sequences' batch indices
    decode_tokens: torch.Tensor  # [num_decodes] int64: their token's row in the flat batch
    decode_max_seq_len: int
    prefill_seqs: torch.Tensor  # [num_prefills] int64
    prefill_tokens: torch.Tensor  # [num_prefill_tokens] int64: their rows, in batch order
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, over prefill_tokens
    prefill_max_query_len: int


def split_mixed_batch(
    query_start_loc: list[int], seq_lens: list[int], device: torch.device | str
) -> MixedBatchSplit | None:
    """Split a flat batch into its decode rows and its prefill rows; None unless it has both."""
    query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)]
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    prefills = [i for i, n in enumerate(query_lens) if n > 1]
    if not decodes or not prefills:
        return None
    prefill_tokens: list[int] = []
    prefill_start = [0]
    for i in prefills:
        prefill_tokens += range(query_start_loc[i], query_start_loc[i + 1])
        prefill_start.append(len(prefill_tokens))

    def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return MixedBatchSplit(
        decode_seqs=tensor(decodes, torch.int64),
        decode_tokens=tensor([query_start_loc[i] for i in decodes], torch.int64),
        decode_max_seq_len=max(seq_lens[i] for i in decodes),
        prefill_seqs=tensor(prefills, torch.int64),
        prefill_tokens=tensor(prefill_tokens, torch.int64),
        prefill_query_start_loc=tensor(prefill_start, torch.int32),
        prefill_max_query_len=max(query_lens[i] for i in prefills),
    )


@dataclass(slots=True)
class TorchAttentionPlan:
    """Which rows of a flat batch the torch backend attends how, and what their decode
    attention reads: everything that depends on the batch but not on the layer, so that it is
    built once per step instead of once per layer.

    Decode rows (one new token) are attended together by `paged_decode_attention`; each prefill
    chunk (several new tokens) alone by `prefill_attention`.
    """

    decode_rows: torch.Tensor  # [num_decodes] int64: the decode tokens' rows in the flat batch
    decode_block_tables: torch.Tensor  # [num_decodes, num_blocks] int64: the blocks they read
    decode_blocks: torch.Tensor  # [num_decodes * num_blocks] int64: the same, flattened
    # [num_unwritten] int64: the gathered rows (sequence * num_blocks * block_size + position)
    # the sequence never wrote, and the additive mask that hides every position past its end:
    # [num_decodes, 1, 1, num_blocks * block_size] float32, 0 or -inf
    decode_unwritten_rows: torch.Tensor
    decode_mask: torch.Tensor
    all_decode: bool  # every row is a decode row, in batch order: no gather of q, no scatter
    prefills: list[tuple[int, int, int, int]]  # (seq index, first row, end row, seq_len)


def plan_torch_attention(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device | str,
) -> TorchAttentionPlan:
    """The torch backend's plan of a batch, from the host's arrays: query_start_loc
    [num_seqs + 1], seq_lens [num_seqs] and the padded block tables [num_seqs, max_num_blocks].
    The decode sequences read the first ceil(max_seq_len / block_size) entries of their block
    tables, whole blocks at a time. Built on the host (numpy), then moved to `device`."""
    query_start_loc, seq_lens = np.asarray(query_start_loc), np.asarray(seq_lens)
    query_lens = np.diff(query_start_loc)
    decodes = np.flatnonzero(query_lens == 1)
    prefills = [
        (i, int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i]))
        for i in np.flatnonzero(query_lens > 1).tolist()
    ]
    decode_lens = seq_lens[decodes].astype(np.int64)
    max_seq_len = int(decode_lens.max()) if len(decodes) else 0
    num_blocks = -(-max_seq_len // block_size)
    tables = np.asarray(block_tables)[decodes, :num_blocks].astype(np.int64)
    # a table entry past the sequence's own blocks repeats its first block, which it wrote
    # (all of it, unless the sequence is shorter than a block): so the only gathered slots it
    # never wrote are the tail of its last block, and those of its first when that is short
    own_blocks = -(-decode_lens // block_size)
    own = np.arange(num_blocks)[None, :] < own_blocks[:, None]
    tables = np.where(own, tables, tables[:, :1])
    positions = np.arange(num_blocks * block_size)[None, :]
    padding = positions >= decode_lens[:, None]
    own_position = own.repeat(block_size, axis=1)
    offset_written = positions % block_size < decode_lens[:, None]
    unwritten = padding & (own_position | ~offset_written)
    mask = np.where(padding, np.float32(-np.inf), np.float32(0.0))

    on_host = torch.device(device).type == "cpu"

    def tensor(values: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(values))
        return host if on_host else host.to(device)

    return TorchAttentionPlan(
        decode_rows=tensor(query_start_loc[decodes].astype(np.int64)),
        decode_block_tables=tensor(tables),
        decode_blocks=tensor(tables.reshape(-1)),
        decode_unwritten_rows=tensor(np.flatnonzero(unwritten)),
        decode_mask=tensor(mask.reshape(len(decodes), 1, 1, num_blocks * block_size)),
        all_decode=not prefills,
        prefills=prefills,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store the new tokens' keys and values in their cache slots.

    k, v: [num_tokens, num_kv_heads, head_dim]; kv_cache_layer: [2, num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64. An FP8 cache stores
    quantize_kv(k, k_scale) and quantize_kv(v, v_scale) (`minillm.model.kv_cache_dtype`).
    """
    _, _, _, num_kv_heads, head_dim = kv_cache_layer.shape
    if is_fp8(kv_cache_layer):
        # index_copy_ has no float8 kernel on the CPU: copy the codes' bytes
        k, v = quantize_kv(k, k_scale).view(torch.uint8), quantize_kv(v, v_scale).view(torch.uint8)
        kv_cache_layer = kv_cache_layer.view(torch.uint8)
    # A slot indexes the (num_blocks * block_size) token rows of the cache, block-major.
    key_rows, value_rows = kv_cache_layer.view(2, -1, num_kv_heads, head_dim).unbind(0)
    if k.dtype != kv_cache_layer.dtype:
        k, v = k.to(kv_cache_layer.dtype), v.to(kv_cache_layer.dtype)
    key_rows.index_copy_(0, slot_mapping, k)
    value_rows.index_copy_(0, slot_mapping, v)


def torch_paged_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context.

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].
    Query j of a sequence with q_len new tokens and seq_len context sits at position
    seq_len - q_len + j and sees context positions 0 .. seq_len - q_len + j.
    Decode sequences (one new token each) are attended together in one batched call;
    sequences with several new tokens (prefill chunks) one at a time. An FP8 cache is read
    back as codes * k_scale (keys) and codes * v_scale (values).
    """
    plan = meta.torch_plan
    if plan is None:  # metadata built without the plan: derive it once, for every layer
        plan = meta.torch_plan = plan_torch_attention(
            meta.query_start_loc.cpu().numpy(),
            meta.seq_lens.cpu().numpy(),
            meta.block_tables.cpu().numpy(),
            meta.block_size,
            q.device,
        )
    if plan.all_decode:
        return paged_decode_attention(q, kv_cache_layer, plan, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    if plan.decode_rows.numel() > 0:
        out[plan.decode_rows] = paged_decode_attention(
            q[plan.decode_rows],
            kv_cache_layer,
            plan,
            scale,
            k_scale,
            v_scale,
        )
    for i, start, end, seq_len in plan.prefills:
        out[start:end] = prefill_attention(
            q[start:end],
            kv_cache_layer,
            meta.block_tables[i],
            seq_len,
            meta.block_size,
            scale,
            k_scale,
            v_scale,
        )
    return out


def prefill_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    block_size: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One sequence's q_len new queries over its seq_len cached tokens, causally.

    q: [q_len, num_heads, head_dim]; block_table: [max_num_blocks] -> [q_len, num_heads,
    head_dim]. Scores and softmax in float32.
    """
    q_len, num_heads, _ = q.shape
    num_kv_heads = kv_cache_layer.shape[3]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    # gather: [num_blocks, block_size, kv_heads, d] -> [seq_len, kv_heads, d]
    k = read_kv(kv_cache_layer[0, blocks].flatten(0, 1)[:seq_len], k_scale)
    v = read_kv(kv_cache_layer[1, blocks].flatten(0, 1)[:seq_len], v_scale)
    # grouped-query attention: query head h reads kv head h // (num_heads / num_kv_heads)
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)
    scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query per sequence over its whole context, for all sequences at once.

    q: [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]; the plan names
    each sequence's blocks (`decode_block_tables`) and its padding. The contexts are gathered
    whole blocks at a time (one index per block_size tokens, keys and values together) into
    one padded batch and attended with a padding mask, in float32. With grouped-query
    attention the query heads that share a KV head become the rows of one query matrix, so
    keys and values are never repeated.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache_layer.shape[3]
    cache = kv_cache_layer.view(torch.uint8) if is_fp8(kv_cache_layer) else kv_cache_layer
    # [2, num_seqs * num_blocks, block_size * kv_heads * d]: a fresh copy, ours to change
    blocks = cache.flatten(2).index_select(1, plan.decode_blocks)
    # a slot the sequence never wrote may hold anything, even NaN: zero it, as the mask
    # alone would let NaN * 0 through
    blocks.view(2, -1, num_kv_heads * head_dim).index_fill_(1, plan.decode_unwritten_rows, 0)
    if blocks.dtype != kv_cache_layer.dtype:
        blocks = blocks.view(kv_cache_layer.dtype)
    # [num_seqs, kv_heads, positions, d] each
    k, v = blocks.view(2, num_seqs, -1, num_kv_heads, head_dim).transpose(2, 3).unbind(0)
    k, v = read_kv(k, k_scale), read_kv(v, v_scale)
    # [num_seqs, kv_heads, group, d]: query head h reads KV head h // group
    q_rows = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if q.dtype != torch.float32:
        q_rows = q_rows.float()
    out = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=plan.decode_mask, scale=scale)
    out = out.reshape(num_seqs, num_heads, head_dim)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cached vectors at `slots`: cache [num_blocks, block_size, num_kv_heads, head_dim],
    slots [...] -> [..., num_kv_heads, head_dim]. index_select over flattened rows is several
    times faster on CPU than advanced indexing with a 2-D index."""
    rows = cache.view(-1, cache.shape[-2] * cache.shape[-1])
    picked = rows.index_select(0, slots.flatten())
    return picked.view(*slots.shape, *cache.shape[-2:])


class AttentionBackend(ABC):
    """Computes attention for a flat batch against the paged KV cache."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write k, v into the cache, then attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        (RoPE already applied to q and k) -> [num_tokens, num_heads, head_dim].
        """


class TorchAttentionBackend(AttentionBackend):
    """The reference backend: `write_kv_cache` then `torch_paged_attention`.

    Each layer has its own instance, which holds the layer's FP8 KV-cache scales (k_scale,
    v_scale: 1.0 unless `calculate_kv_scales` calibrates them on the first forward) and the
    batch-invariant switch (`minillm.model.batch_invariant`): with it, every query token
    attends alone, over exactly its visible keys (`batch_invariant_attention`).
    """

    def __init__(self) -> None:
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.calculate_kv_scales = False  # True: set the scales from the next forward's k, v
        self.batch_invariant = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self.calculate_kv_scales and is_fp8(kv_cache_layer):
            self.k_scale, self.v_scale = calibrated_scales(k, v)
            self.calculate_kv_scales = False
        write_kv_cache(k, v, kv_cache_layer, meta.slot_mapping, self.k_scale, self.v_scale)
        attend = batch_invariant_attention if self.batch_invariant else torch_paged_attention
        return attend(q, kv_cache_layer, meta, scale, self.k_scale, self.v_scale)


def batch_invariant_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention in which each query token's result does not depend on the batch around it.

    Every query token is computed alone: its scores against exactly the keys it sees
    (positions 0 .. p, gathered through its block table), a softmax over those p + 1 scores
    and the weighted sum of the p + 1 values, in float32. The shapes of these operations,
    hence the order of every reduction, depend only on p, never on the other sequences of
    the batch, on how many new tokens the sequence brings in this step (the chunk size), or
    on padding. Slow (a loop over tokens): the mode is for reproducibility, not speed.
    """
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    num_kv_heads = kv_cache_layer.shape[3]
    group = num_heads // num_kv_heads
    block_size = meta.block_size
    query_start_loc = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i in range(meta.num_seqs):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        seq_len = seq_lens[i]
        positions = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[i].long()[positions // block_size] * block_size
        slots = slots + positions % block_size
        keys = read_kv(gather_slots(kv_cache_layer[0], slots), k_scale)  # [seq_len, kv_heads, d]
        values = read_kv(gather_slots(kv_cache_layer[1], slots), v_scale)
        first_pos = seq_len - (end - start)
        for j in range(end - start):
            n = first_pos + j + 1  # keys 0 .. position
            qj = q[start + j].float().view(num_kv_heads, group, -1)  # [kv_heads, group, d]
            k_seen = keys[:n].transpose(0, 1)  # [kv_heads, n, d]
            v_seen = values[:n].transpose(0, 1)
            probs = (torch.bmm(qj, k_seen.transpose(1, 2)) * scale).softmax(dim=-1)
            out[start + j] = torch.bmm(probs, v_seen).reshape(num_heads, -1).to(q.dtype)
    return out


# name -> "module:ClassName", imported on first use so that a backend's dependencies
# (Triton, for instance) are needed only by those who select it.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "minillm.model.attention:TorchAttentionBackend",
    "triton": "minillm.model.triton_backend:TritonAttentionBackend",
}


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate the attention backend registered under `name`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; expected one of {sorted(ATTENTION_BACKENDS)}"
        )
    module_name, class_name = ATTENTION_BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls()
