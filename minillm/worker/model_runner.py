"""The model runner: from a scheduler's plan to one sampled token per sequence.

Each step it packs the new tokens of every scheduled request into one flat batch (no padding:
prefill chunks and decode tokens side by side), tells attention where each token's keys and
values go and which blocks each sequence reads (`AttentionMetadata`), runs the model once,
and samples from the hidden state of the last token of every request whose step samples.

It also owns the KV cache itself: one tensor per layer,
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, whose blocks the KV-cache manager hands
out by id. On a GPU, decode-only steps can replay CUDA graphs (`minillm.worker.cuda_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.request import Request
from minillm.core.scheduler import ScheduledRequest, SchedulerOutput
from minillm.model.attention import AttentionMetadata
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.outputs import SampledToken
from minillm.worker.cuda_graphs import CUDAGraphConfig, CUDAGraphRunner
from minillm.worker.sampler import Sampler, SamplerOutput, SamplingState


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]


@dataclass(slots=True)
class ModelInput:
    """A flat batch of num_tokens new tokens from num_seqs requests."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64: each token's position in its sequence
    meta: AttentionMetadata
    # [num_sampling] int64: the last new token of each request whose step samples
    logits_indices: torch.Tensor


def prepare_inputs(
    scheduled: list[ScheduledRequest],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> ModelInput:
    """Pack the new tokens of the scheduled requests back to back into one batch.

    Request i contributes its tokens num_computed_tokens .. num_computed_tokens + num_new_tokens
    - 1. Token at position p is written to slot block_table[p // block_size] * block_size +
    p % block_size, and attends to the request's first p + 1 tokens.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    for chunk, block_table in zip(scheduled, block_tables, strict=True):
        start = chunk.num_computed_tokens
        end = start + chunk.num_new_tokens
        input_ids += chunk.request.all_token_ids[start:end]
        positions += range(start, end)
        slot_mapping += [
            block_table[p // block_size] * block_size + p % block_size for p in range(start, end)
        ]
        query_start_loc.append(query_start_loc[-1] + chunk.num_new_tokens)
        seq_lens.append(end)
    max_num_blocks = max(len(table) for table in block_tables)
    padded_tables = [table + [0] * (max_num_blocks - len(table)) for table in block_tables]
    # only a request that reached its last token samples; its logits come from that token
    logits_indices = [
        query_start_loc[i + 1] - 1 for i, chunk in enumerate(scheduled) if chunk.samples
    ]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slot_mapping, torch.int64),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(padded_tables, torch.int32),
        max_query_len=max(chunk.num_new_tokens for chunk in scheduled),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return ModelInput(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        meta=meta,
        logits_indices=tensor(logits_indices, torch.int64),
    )


class ModelRunner:
    """Runs the model and the sampler on the batches the scheduler plans."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache_manager: KVCacheManager,
        sampler: Sampler,
        cuda_graphs: CUDAGraphConfig | None = None,
    ) -> None:
        self.model = model
        self.kv_cache_manager = kv_cache_manager
        self.sampler = sampler
        weight = model.lm_head.weight
        self.device = weight.device
        self.block_size = kv_cache_manager.block_size
        self.kv_caches = allocate_kv_caches(
            model.config,
            kv_cache_manager.block_pool.num_blocks,
            self.block_size,
            weight.dtype,
            self.device,
        )
        self.cuda_graph_runner = (
            None
            if cuda_graphs is None
            else CUDAGraphRunner(model, self.kv_caches, self.block_size, cuda_graphs)
        )

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, SampledToken]:
        """One forward pass over the planned batch; returns the token of every sequence that
        samples, by request id (the forks of an n > 1 request included)."""
        self.copy_blocks(self.kv_cache_manager.take_copy_on_write())
        scheduled = scheduler_output.scheduled
        block_tables = [
            self.kv_cache_manager.get_block_ids(chunk.request.request_id) for chunk in scheduled
        ]
        model_input = prepare_inputs(scheduled, block_tables, self.block_size, self.device)
        hidden = self.forward(model_input)
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
        return self.sample(logits, [chunk.request for chunk in scheduled if chunk.samples])

    def forward(self, model_input: ModelInput) -> torch.Tensor:
        """Hidden states of the batch: a CUDA graph replay for a decode step when captured."""
        ids, positions, meta = model_input.input_ids, model_input.positions, model_input.meta
        graphs = self.cuda_graph_runner
        if graphs is not None and graphs.can_run(ids, meta):
            return graphs.run(ids, positions, meta)
        return self.model(ids, positions, self.kv_caches, meta)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give each (src, dst) block pair the same keys and values, every layer.

        In order: a later copy may read a block an earlier one has not touched yet."""
        for src, dst in copies:
            for kv_cache in self.kv_caches:
                kv_cache[:, dst] = kv_cache[:, src]

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> dict[str, SampledToken]:
        """One token for each request from its row of logits: [num_requests, vocab_size].

        A request about to fork (n > 1) samples n tokens from the same row, one per sequence,
        each with its own generator: the prompt is computed once, the completions diverge here.
        """
        rows: list[int] = []
        seqs: list[Request] = []
        for row, request in enumerate(requests):
            for seq in (request, *request.pending_forks):
                rows.append(row)
                seqs.append(seq)
        states = [
            SamplingState(
                params=seq.sampling_params,
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                generator=seq.generator,
                eos_token_ids=tuple(seq.eos_token_ids),
            )
            for seq in seqs
        ]
        output = self.sampler(logits[rows], states)
        return {
            seq.request_id: SampledToken(output.token_ids[i], sampled_logprobs(output, i, seq))
            for i, seq in enumerate(seqs)
        }


def sampled_logprobs(output: SamplerOutput, i: int, seq: Request) -> dict[int, float] | None:
    """{token_id: logprob} of row i's sampled token and its top-n, if the request asked."""
    if seq.sampling_params.logprobs is None:
        return None
    logprobs = {output.token_ids[i]: output.logprobs[i]}
    logprobs.update(output.top_logprobs[i] or [])
    return logprobs
