"""CUDA graphs for decode steps: capture a forward pass once per batch size, replay it.

A decode step of a small model is hundreds of kernel launches, each a few microseconds of
GPU work; the CPU time to issue them (launch overhead) can exceed the time the GPU spends
running them. A CUDA graph records every launch of one forward pass and replays them all
with one call, so the CPU cost of a step no longer grows with the number of kernels.

A replay repeats the recorded launches exactly: the same shapes, grids and memory
addresses. Hence:

- the inputs live in static buffers that each step copies its batch into;
- a graph is captured for each batch size in a set of buckets (1, 2, 4, 8, 16, 24, ...,
  max_num_seqs) and a batch is padded up to the next bucket. A padded row has cache slot -1
  (the KV store skips it) and context length 0 (decode attention returns 0 for it), and its
  output is dropped;
- whatever sizes a launch is fixed at capture: the metadata says max_seq_len =
  max_model_len, so decode attention picks its split count for the longest context it may
  meet, not the batch's.

Only decode-only batches (one new token per sequence) replay; prefill and mixed batches run
eagerly, since their token counts vary too much to bucket. Only an attention backend that
never waits on the GPU from the host (no `.tolist()`, no `.item()`) can be captured: the
"triton" one. vLLM captures the same way; `enforce_eager=True` turns it off there and here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minillm.model.attention import AttentionMetadata
from minillm.model.llama import LlamaForCausalLM

# backends whose forward pass can be captured
CUDA_GRAPH_BACKENDS = frozenset({"triton"})
PAD_SLOT_ID = -1


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, then multiples of 8 below max_num_seqs, then max_num_seqs."""
    sizes = {1, 2, 4, *range(8, max_num_seqs, 8), max_num_seqs}
    return sorted(size for size in sizes if size <= max_num_seqs)


@dataclass(slots=True)
class CUDAGraphConfig:
    max_num_seqs: int
    max_model_len: int


class CUDAGraphRunner:
    """Decode forward passes captured per batch-size bucket over the model's KV caches."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        config: CUDAGraphConfig,
    ) -> None:
        device = kv_caches[0].device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the KV caches on a cuda device, got {device}")
        if model.attention_backend not in CUDA_GRAPH_BACKENDS:
            raise ValueError(
                f"the {model.attention_backend!r} attention backend cannot be captured in a "
                f"CUDA graph; use one of {sorted(CUDA_GRAPH_BACKENDS)} or enforce_eager=True"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = config.max_model_len
        self.batch_sizes = graph_batch_sizes(config.max_num_seqs)
        self.max_num_blocks = math.ceil(config.max_model_len / block_size)
        largest = self.batch_sizes[-1]

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        # static inputs shared by every graph; a graph of batch size b reads their first b rows
        self.input_ids = zeros(largest, dtype=torch.int64)
        self.positions = zeros(largest, dtype=torch.int64)
        self.slot_mapping = torch.full((largest,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.seq_lens = zeros(largest, dtype=torch.int32)
        self.block_tables = zeros(largest, self.max_num_blocks, dtype=torch.int32)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            # largest first: the smaller graphs then fit in the memory pool it reserved
            for batch_size in reversed(self.batch_sizes):
                self._capture(batch_size)

    def _meta(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # fixed at capture: splits for the longest context
            block_size=self.block_size,
        )

    def _forward(self, batch_size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:batch_size],
            self.positions[:batch_size],
            self.kv_caches,
            self._meta(batch_size),
        )

    def _capture(self, batch_size: int) -> None:
        # a warm-up run outside the graph compiles the kernels and builds lazy state (the
        # RoPE table); every slot is PAD_SLOT_ID, so no KV cache entry is written
        self._forward(batch_size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[batch_size] = self._forward(batch_size)
        self.graphs[batch_size] = graph

    def can_run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """True for a decode-only batch that fits the largest bucket."""
        return (
            meta.max_query_len == 1
            and input_ids.shape[0] == meta.num_seqs <= self.batch_sizes[-1]
            and meta.block_tables.shape[1] <= self.max_num_blocks
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Copy the batch into the static inputs, pad it to its bucket, replay: hidden states
        [num_seqs, hidden_size] (a view of the graph's output, valid until the next replay)."""
        num_seqs = meta.num_seqs
        batch_size = next(size for size in self.batch_sizes if size >= num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.slot_mapping[num_seqs:batch_size].fill_(PAD_SLOT_ID)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.seq_lens[num_seqs:batch_size].fill_(0)
        # columns past the batch's widest table are never read: seq_lens end before them
        self.block_tables[:num_seqs, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[batch_size].replay()
        return self.outputs[batch_size][:num_seqs]


def profile_graph_bytes(model: LlamaForCausalLM, block_size: int, config: CUDAGraphConfig) -> int:
    """The device memory the decode graphs keep once captured (their shared memory pool, the
    split-KV partial outputs of the longest context included, and the static buffers),
    measured by capturing them once over a one-block throwaway KV cache and released again.
    The KV cache is sized after this amount is set aside, as vLLM's profiling does for
    the graphs it will capture."""
    device = model.lm_head.weight.device
    config_ = model.config
    shape = (2, 1, block_size, config_.num_key_value_heads, config_.head_dim)
    dtype = model.lm_head.weight.dtype
    kv_caches = [
        torch.zeros(shape, dtype=dtype, device=device) for _ in range(config_.num_hidden_layers)
    ]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    runner = CUDAGraphRunner(model, kv_caches, block_size, config)
    torch.cuda.synchronize(device)
    used = torch.cuda.memory_reserved(device) - before
    del runner, kv_caches
    torch.cuda.empty_cache()
    return max(0, used)
