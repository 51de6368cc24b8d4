"""The model runner: from a scheduler's plan to one sampled token per sequence.

Each step it packs the new tokens of every scheduled request into one flat batch (no padding:
prefill chunks and decode tokens side by side), tells attention where each token's keys and
values go and which blocks each sequence reads (`AttentionMetadata`), runs the model once,
and samples from the hidden state of the last token of every request whose step samples.

It also owns the KV cache itself: one tensor per layer,
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, whose blocks the scheduler's KV-cache
manager hands out by id. Everything the runner needs about a step comes in the scheduler's
output: each request's chunk, its block table, the block copies to make first, and which
sequences sample from which row. It keeps only tensors and the random generators of seeded
requests. On a GPU, decode-only steps can replay CUDA graphs (`minillm.worker.cuda_graphs`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from minillm.core.request import Request
from minillm.core.scheduler import ScheduledRequest, SchedulerOutput
from minillm.model.attention import AttentionMetadata, plan_torch_attention, split_mixed_batch
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.model.lora import LoRAManager
from minillm.outputs import SampledToken
from minillm.worker.cuda_graphs import CUDAGraphConfig, CUDAGraphRunner
from minillm.worker.decode_trace import DecodeTrace, can_trace
from minillm.worker.sampler import Sampler, SamplerOutput, SamplingState, make_generator

TORCH_TO_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


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
    block_size: int,
    device: torch.device,
    input_token_ids: list[list[int]] | None = None,
) -> ModelInput:
    """Pack the new tokens of the scheduled requests back to back into one batch.

    Request i contributes its tokens num_computed_tokens .. num_computed_tokens + num_new_tokens
    - 1 (read from its all_token_ids, or input_token_ids[i] when given: the copy a plan
    carries). Token at position p is written to slot block_table[p // block_size] * block_size
    + p % block_size, and attends to the request's first p + 1 tokens.

    The arithmetic runs on the host over whole arrays (numpy), one operation per quantity
    rather than one per token, as vLLM's input batch does; the tensors then go to `device`.
    """
    n = len(scheduled)
    num_new = np.fromiter((chunk.num_new_tokens for chunk in scheduled), np.int64, n)
    computed = np.fromiter((chunk.num_computed_tokens for chunk in scheduled), np.int64, n)
    seq_lens = computed + num_new
    query_start_loc = np.zeros(n + 1, np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    if input_token_ids is None:
        input_token_ids = [
            chunk.request.all_token_ids[chunk.num_computed_tokens : end]
            for chunk, end in zip(scheduled, seq_lens.tolist(), strict=True)
        ]
    input_ids = np.fromiter(itertools.chain.from_iterable(input_token_ids), np.int64)
    # each token's request, and its position in that request
    token_seq = np.repeat(np.arange(n), num_new)
    positions = np.arange(len(token_seq)) - query_start_loc[token_seq] + computed[token_seq]
    # the block tables, padded with 0 to the longest
    table_lens = np.fromiter((len(chunk.block_ids) for chunk in scheduled), np.int64, n)
    block_tables = np.zeros((n, table_lens.max()), np.int32)
    block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(chunk.block_ids for chunk in scheduled), np.int32
    )
    slot_mapping = (
        block_tables[token_seq, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    # only a request that reached its last token samples; its logits come from that token
    samples = np.fromiter((chunk.samples for chunk in scheduled), bool, n)
    logits_indices = query_start_loc[1:][samples] - 1

    on_host = torch.device(device).type == "cpu"

    def tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        # the dtype set on the host: on a CPU the array's memory is the tensor's, no copy
        host = torch.from_numpy(values.astype(TORCH_TO_NUMPY[dtype], copy=False))
        return host if on_host else host.to(device)

    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=tensor(slot_mapping, torch.int64),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(block_tables, torch.int32),
        max_query_len=int(num_new.max()),
        max_seq_len=max(lens),
        block_size=block_size,
        mixed=split_mixed_batch(starts, lens, device),
        torch_plan=plan_torch_attention(
            query_start_loc, seq_lens, block_tables, block_size, device
        ),
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
        sampler: Sampler,
        num_blocks: int,
        block_size: int,
        cuda_graphs: CUDAGraphConfig | None = None,
        kv_cache_dtype: torch.dtype | None = None,  # None: the model's dtype
        lora_manager: LoRAManager | None = None,  # multi-LoRA: adapters applied per row
        trace_decode: bool = False,  # on a CPU: decode steps replay a traced forward
    ) -> None:
        self.model = model
        self.lora_manager = lora_manager
        self.sampler = sampler
        # any weight: a pipeline stage may hold no LM head
        weight = next(model.parameters())
        self.device = weight.device
        self.dtype = weight.dtype
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(
            model.config, num_blocks, block_size, kv_cache_dtype or weight.dtype, self.device
        )
        self.cuda_graph_runner = (
            None
            if cuda_graphs is None
            else CUDAGraphRunner(model, self.kv_caches, self.block_size, cuda_graphs)
        )
        self.decode_trace = (
            DecodeTrace(model, self.kv_caches, self.block_size)
            if trace_decode and lora_manager is None and can_trace(model, self.kv_caches)
            else None
        )
        # the random stream of each seeded sequence, created when it first samples
        self.generators: dict[str, torch.Generator | None] = {}

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, SampledToken]:
        """One forward pass over the planned batch; returns the token of every sequence that
        samples, by request id (the forks of an n > 1 request included)."""
        for request_id in scheduler_output.finished_req_ids:
            self.generators.pop(request_id, None)
        self.copy_blocks(scheduler_output.block_copies)
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return {}
        # the plan's own copy of the input tokens: async scheduling moves the requests on
        model_input = prepare_inputs(
            scheduled, self.block_size, self.device, [chunk.token_ids for chunk in scheduled]
        )
        if self.lora_manager is not None:
            # each token row runs with its request's adapter (0: the base model alone)
            token_lora_ids = [
                lora_id
                for chunk in scheduled
                for lora_id in [lora_int_id(chunk.request)] * chunk.num_new_tokens
            ]
            self.lora_manager.set_active(token_lora_ids, self.device)
        try:
            hidden = self.forward(model_input)
        finally:
            if self.lora_manager is not None:
                self.lora_manager.clear()
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
        return self.sample(logits, [chunk.sampling_seqs for chunk in scheduled if chunk.samples])

    def forward(self, model_input: ModelInput) -> torch.Tensor:
        """Hidden states of the batch: for a decode step, a CUDA graph replay when captured,
        or on a CPU the traced forward's (`minillm.worker.decode_trace`)."""
        ids, positions, meta = model_input.input_ids, model_input.positions, model_input.meta
        graphs = self.cuda_graph_runner
        lora_active = self.lora_manager is not None and self.lora_manager.active
        if graphs is not None and not lora_active and graphs.can_run(ids, meta):
            return graphs.run(ids, positions, meta)
        trace = self.decode_trace
        if trace is not None and trace.can_run(ids, meta):
            return trace.run(ids, positions, meta)
        return self.model(ids, positions, self.kv_caches, meta)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give each (src, dst) block pair the same keys and values, every layer.

        In order: a later copy may read a block an earlier one has not touched yet."""
        for src, dst in copies:
            for kv_cache in self.kv_caches:
                kv_cache[:, dst] = kv_cache[:, src]

    def sample(self, logits: torch.Tensor, rows: list[list[Request]]) -> dict[str, SampledToken]:
        """One token for each sequence from its row of logits: [num_rows, vocab_size].

        rows[i] lists the sequences that sample from row i: one, or for a request that forks
        in this step (n > 1) the request and its forks, each with its own generator: the
        prompt is computed once, the completions diverge here.
        """
        row_of_seq = [row for row, seqs in enumerate(rows) for _ in seqs]
        seqs = [seq for seqs in rows for seq in seqs]
        states = [
            SamplingState(
                params=seq.sampling_params,
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                generator=self._generator(seq),
                eos_token_ids=seq.eos_token_ids,
                request_id=seq.request_id,
            )
            for seq in seqs
        ]
        one_to_one = row_of_seq == list(range(len(rows)))  # no forks: no copy of the logits
        output = self.sampler(logits if one_to_one else logits[row_of_seq], states)
        return {
            seq.request_id: SampledToken(output.token_ids[i], sampled_logprobs(output, i, seq))
            for i, seq in enumerate(seqs)
        }

    def generator_states(self, seq_ids: list[str]) -> dict[str, torch.Tensor | None]:
        """The state of each sequence's random stream before a step (None: not created yet),
        for `restore_generators` when the step is run again."""
        return {
            seq_id: None if (gen := self.generators.get(seq_id)) is None else gen.get_state()
            for seq_id in seq_ids
        }

    def restore_generators(self, states: dict[str, torch.Tensor | None]) -> None:
        """Put each sequence's random stream back where `generator_states` found it: a step
        that failed and is run again draws the same numbers a clean run draws, so a seeded
        request's output does not depend on a neighbour's fault."""
        for seq_id, state in states.items():
            if state is None:
                self.generators.pop(seq_id, None)  # made by the failed attempt: made again
            else:
                self.generators[seq_id].set_state(state)

    def _generator(self, seq: Request) -> torch.Generator | None:
        if seq.request_id not in self.generators:
            params = seq.sampling_params
            self.generators[seq.request_id] = make_generator(params.seed, seq.index, self.device)
        return self.generators[seq.request_id]


def lora_int_id(request: Request) -> int:
    """The id of the request's LoRA adapter, 0 for the base model."""
    return 0 if request.lora_request is None else request.lora_request.lora_int_id


def sampled_logprobs(output: SamplerOutput, i: int, seq: Request) -> dict[int, float] | None:
    """{token_id: logprob} of row i's sampled token and its top-n, if the request asked."""
    if seq.sampling_params.logprobs is None:
        return None
    logprobs = {output.token_ids[i]: output.logprobs[i]}
    logprobs.update(output.top_logprobs[i] or [])
    return logprobs


@torch.inference_mode()
def profile_peak_bytes(model: LlamaForCausalLM, num_tokens: int) -> int:
    """The device memory a forward over `num_tokens` prompt tokens peaks at, weights included
    (CUDA's own count), measured with a throwaway KV cache just big enough for them."""
    device = model.lm_head.weight.device
    block_size = 16
    num_blocks = -(-num_tokens // block_size)
    kv_caches = allocate_kv_caches(
        model.config, num_blocks, block_size, model.lm_head.weight.dtype, device
    )
    seq_len = min(num_tokens, model.config.max_position_embeddings)
    num_seqs = -(-num_tokens // seq_len)
    lengths = [seq_len] * (num_seqs - 1) + [num_tokens - seq_len * (num_seqs - 1)]
    block_tables, start = [], 0
    for length in lengths:
        num_seq_blocks = -(-length // block_size)
        block_tables.append(list(range(start, start + num_seq_blocks)))
        start += num_seq_blocks
    scheduled = [
        _ProfileChunk(length, table) for length, table in zip(lengths, block_tables, strict=True)
    ]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model_input = prepare_inputs(scheduled, block_size, device)
    hidden = model(model_input.input_ids, model_input.positions, kv_caches, model_input.meta)
    model.compute_logits(hidden[model_input.logits_indices])
    torch.cuda.synchronize(device)
    peak_bytes = torch.cuda.max_memory_allocated(device)
    del kv_caches, hidden
    torch.cuda.empty_cache()
    # the throwaway cache was counted in the peak but is not the model's
    return peak_bytes - num_blocks * block_size * model.config.kv_bytes_per_token(
        model.lm_head.weight.element_size()
    )


class _ProfileChunk:
    """A whole dummy prompt of `length` tokens, shaped like a ScheduledRequest for
    prepare_inputs."""

    def __init__(self, length: int, block_ids: list[int]) -> None:
        self.request = _DummyTokens(length)
        self.num_computed_tokens = 0
        self.num_new_tokens = length
        self.samples = True
        self.block_ids = block_ids


class _DummyTokens:
    def __init__(self, length: int) -> None:
        self.all_token_ids = [0] * length
