"""The engine's "triton" attention backend: the kernels of this package behind
`minillm.model.attention.AttentionBackend`.

Each layer's step first stores the new keys and values in their cache slots
(`reshape_and_cache`), then:

- a decode-only batch (every sequence brings one new token, `max_query_len == 1`) runs
  `paged_decode_attention`: one query per sequence over its block table, split-KV;
- a prefill-only batch runs `flash_attention` over the whole flat batch: each sequence's
  new tokens attend causally to themselves and to the prefix already in the cache (earlier
  chunks, prefix-cache hits), read through the block table;
- a mixed batch (chunked prefill puts decode tokens beside prefill chunks) runs both: its
  decode rows, gathered, through `paged_decode_attention`, and its prefill chunks through
  `flash_attention`, each output scattered back to its rows. In the flash kernel a decode
  row would be one useful query row of a many-row tile, with no split over its long
  context; the decode kernel gives it split-KV. (vLLM's unified Triton attention instead
  packs a GQA group's query heads into the tile rows.) The rows come from
  `AttentionMetadata.mixed`, which the model runner builds on the host.

Everything the launches need is known on the host (`max_query_len`, `max_seq_len`) or
stays on the device, so a decode step has no device-to-host sync and can be captured in a
CUDA graph. With this backend the model also runs RMSNorm and RoPE as Triton kernels
(see `minillm.model.llama`).
"""

from __future__ import annotations

import torch

from kernels.flash_attention import flash_attention
from kernels.kv_cache import reshape_and_cache
from kernels.paged_decode import paged_decode_attention
from minillm.model.attention import AttentionBackend, AttentionMetadata, split_mixed_batch


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels: flash attention for prefill, split-KV for decode."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        decode_only = meta.max_query_len == 1
        if decode_only and q.shape[0] != meta.num_seqs:
            raise ValueError(
                f"a decode batch (max_query_len 1) needs one token per sequence: "
                f"{q.shape[0]} tokens for {meta.num_seqs} sequences"
            )
        reshape_and_cache(k, v, kv_cache_layer, meta.slot_mapping)
        if decode_only:
            return paged_decode_attention(
                q, kv_cache_layer, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len
            )
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        prefix_lens = (meta.seq_lens - q_lens).to(torch.int32)
        mixed = meta.mixed
        if mixed is None and meta.max_query_len > 1 and meta.num_seqs > 1:
            # metadata built without the split (a benchmark, a test): derive it, with a sync
            mixed = split_mixed_batch(
                meta.query_start_loc.tolist(), meta.seq_lens.tolist(), q.device
            )
        if mixed is not None:
            return self._mixed(q, k, v, kv_cache_layer, meta, mixed, prefix_lens, scale)
        return flash_attention(
            q,
            k,
            v,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            kv_cache=kv_cache_layer,
            block_tables=meta.block_tables,
            prefix_lens=prefix_lens,
        )

    @staticmethod
    def _mixed(q, k, v, kv_cache_layer, meta, mixed, prefix_lens, scale):
        """Decode rows through the split-KV decode kernel, prefill chunks through flash."""
        out = torch.empty_like(q)
        rows = mixed.decode_tokens
        out[rows] = paged_decode_attention(
            q[rows],
            kv_cache_layer,
            meta.block_tables[mixed.decode_seqs],
            meta.seq_lens[mixed.decode_seqs],
            scale,
            mixed.decode_max_seq_len,
        )
        rows = mixed.prefill_tokens
        out[rows] = flash_attention(
            q[rows],
            k[rows],
            v[rows],
            mixed.prefill_query_start_loc,
            mixed.prefill_max_query_len,
            scale,
            kv_cache=kv_cache_layer,
            block_tables=meta.block_tables[mixed.prefill_seqs],
            prefix_lens=prefix_lens[mixed.prefill_seqs],
        )
        return out
