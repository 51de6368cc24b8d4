"""The engine: requests in, one step at a time, outputs out.

`LLMEngine` wires the pieces together. `add_request` checks a prompt and queues it; every
`step` is one iteration of the loop all serving engines share:

    plan = scheduler.schedule()                    # who runs, how many tokens each
    tokens = model_runner.execute_model(plan)      # one forward pass, one sample per sequence
    done = scheduler.update_from_output(plan, tokens)  # append, detokenize, stop or go on

and returns a `RequestOutput` for every prompt that made progress. `EngineArgs` holds the
options, with vLLM's names.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.request import Request, RequestStatus
from minillm.core.scheduler import BATCHING_TYPES, SCHEDULING_POLICIES, Scheduler, SchedulerOutput
from minillm.engine.metrics import EngineStats
from minillm.engine.output_processor import make_completion_output
from minillm.model.config import ModelConfig
from minillm.model.loader import DEFAULT_MODEL, load_model
from minillm.model.tokenizer import IncrementalDetokenizer
from minillm.outputs import RequestOutput
from minillm.sampling_params import SamplingParams
from minillm.worker.cuda_graphs import CUDA_GRAPH_BACKENDS, CUDAGraphConfig
from minillm.worker.model_runner import ModelRunner
from minillm.worker.sampler import Sampler, make_generator

# max_model_len defaults to the model's limit, but at most this: a CPU pool for 40k-token
# contexts (Qwen3) would be gigabytes
DEFAULT_MAX_MODEL_LEN = 4096
# a pool sized from max_num_seqs * max_model_len / 2 stays under this unless asked otherwise
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30


@dataclass(slots=True)
class EngineArgs:
    """Engine options (vLLM's names). None means: derive a default from the model."""

    model: str | os.PathLike = DEFAULT_MODEL
    dtype: str | None = None  # None: the checkpoint's torch_dtype
    device: str | None = None  # None: "cuda" when available, else "cpu"
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # None: 2048, raised to max_model_len without chunks
    max_model_len: int | None = None  # None: max_position_embeddings, at most 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_gpu_blocks: int | None = None  # KV-cache pool size in blocks ...
    kv_cache_memory_bytes: int | None = None  # ... or as a memory budget; default: see num_blocks
    attention_backend: str | None = None  # None: "triton" on CUDA, "torch" on the CPU
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    seed: int = 0  # seeds the generator that rows without their own seed share
    scheduling_policy: str = "fcfs"  # the waiting queue's order: "fcfs", "priority" or "sjf"
    batching_type: str = "continuous"  # or "static": a new batch only when the last one is done

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.batching_type not in BATCHING_TYPES:
            raise ValueError(
                f"batching_type must be one of {BATCHING_TYPES}, got {self.batching_type!r}"
            )
        for name in ("block_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_num_batched_tokens", "max_model_len", "num_gpu_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None or >= 1, got {value}")
        if self.num_gpu_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_gpu_blocks or kv_cache_memory_bytes, not both")

    def resolve_max_model_len(self, config: ModelConfig) -> int:
        limit = config.max_position_embeddings
        if self.max_model_len is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        return self.max_model_len

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return 2048
        return max(2048, max_model_len)

    def num_blocks(self, config: ModelConfig, dtype: torch.dtype, max_model_len: int) -> int:
        """KV-cache blocks: num_gpu_blocks, or what kv_cache_memory_bytes holds, or by default
        room for max_num_seqs sequences half as long as max_model_len (at most 1 GiB)."""
        if self.num_gpu_blocks is not None:
            num_blocks = self.num_gpu_blocks
        else:
            budget_bytes = self.kv_cache_memory_bytes
            if budget_bytes is None:
                num_tokens = self.max_num_seqs * max_model_len // 2
                budget_bytes = min(
                    num_tokens * config.kv_bytes_per_token(dtype.itemsize),
                    DEFAULT_KV_CACHE_MEMORY_BYTES,
                )
            num_blocks = KVCacheManager.num_blocks_for_budget(
                budget_bytes, self.block_size, config, dtype
            )
        # a single sequence of max_model_len tokens must fit, or it could never finish
        min_blocks = math.ceil(max_model_len / self.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {self.block_size} tokens) cannot hold one "
                f"sequence of max_model_len={max_model_len} tokens; give at least {min_blocks} "
                "blocks or a smaller max_model_len"
            )
        return num_blocks


@dataclass(slots=True, eq=False)
class RequestGroup:
    """A prompt and its sampling_params.n sequences (index 0 is the one scheduled first)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class LLMEngine:
    """Continuous-batching inference over one model: add_request, then step until done."""

    def __init__(
        self, engine_args: EngineArgs, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        args = engine_args
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_cuda = torch.device(device).type == "cuda"
        backend = args.attention_backend or ("triton" if on_cuda else "torch")
        loaded = load_model(args.model, args.dtype, device, backend)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.device = torch.device(device)
        self.clock = clock
        self.max_model_len = args.resolve_max_model_len(self.config)
        dtype = loaded.model.lm_head.weight.dtype
        num_blocks = args.num_blocks(self.config, dtype, self.max_model_len)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, args.block_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.resolve_max_num_batched_tokens(self.max_model_len),
            max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            clock=clock,
            scheduling_policy=args.scheduling_policy,
            batching_type=args.batching_type,
        )
        sampler = Sampler(torch.Generator(self.device).manual_seed(args.seed))
        # decode steps replay CUDA graphs unless told not to or the backend cannot be captured
        use_graphs = on_cuda and not args.enforce_eager and backend in CUDA_GRAPH_BACKENDS
        self.model_runner = ModelRunner(
            loaded.model,
            self.kv_cache_manager,
            sampler,
            CUDAGraphConfig(args.max_num_seqs, self.max_model_len) if use_graphs else None,
        )
        self.stats = EngineStats()
        self.groups: dict[str, RequestGroup] = {}  # unfinished prompts by request id
        self.group_of_seq: dict[str, RequestGroup] = {}  # the same, by their sequences' ids
        self.aborted: list[RequestGroup] = []  # to report as finished in the next step

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a prompt (text or token ids). Raises ValueError, and queues nothing, when the
        prompt or the options cannot be served; the requests in flight carry on.

        priority: with scheduling_policy="priority", lower values are served first (vLLM's
        convention); any other policy accepts only the default 0.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if priority != 0 and self.scheduler.scheduling_policy != "priority":
            raise ValueError(
                f"priority={priority} needs scheduling_policy='priority', "
                f"this engine uses {self.scheduler.scheduling_policy!r}"
            )
        prompt_text, prompt_token_ids = self._tokenize(prompt)
        self._check_prompt(prompt_token_ids)
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(
                f"n={params.n} completions cannot run together with "
                f"max_num_seqs={self.scheduler.max_num_seqs}"
            )
        seq_ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
        if request_id in self.groups or any(seq_id in self.group_of_seq for seq_id in seq_ids):
            raise ValueError(f"request id {request_id!r} is already in use")

        arrival_time = self.clock() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, prompt_text, prompt_token_ids)
        for index, seq_id in enumerate(seq_ids):
            seq = Request(
                seq_id,
                list(prompt_token_ids),
                params,
                arrival_time,
                eos_token_ids=self.eos_token_ids,
                index=index,
                priority=priority,
                generator=make_generator(params.seed, index, self.device),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens
                ),
            )
            group.seqs.append(seq)
        # n > 1: one sequence is scheduled; the others fork from it once the prompt is computed
        group.seqs[0].pending_forks = group.seqs[1:]
        self.groups[request_id] = group
        self.group_of_seq.update((seq_id, group) for seq_id in seq_ids)
        self.scheduler.add_request(group.seqs[0])

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a str or a list of token ids, got {prompt!r:.80}")

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: expected at least one token")
        vocab_size = self.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids must be in [0, {vocab_size}) for this model, got {bad[:5]}"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len="
                f"{self.max_model_len} leaves room for at most {self.max_model_len - 1} "
                "prompt tokens and one output token"
            )

    def abort_request(self, request_id: str) -> None:
        """Stop a prompt's sequences and free their blocks; the next step reports it finished
        with finish_reason "abort". Unknown or finished ids are ignored."""
        group = self.groups.get(request_id)
        if group is None:
            return
        seq_ids = [seq.request_id for seq in group.seqs]
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
        self._forget(group)
        self.aborted.append(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups or self.aborted)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, update the requests, report progress."""
        scheduler_output = self.scheduler.schedule()
        sampled = {}
        if scheduler_output.scheduled:
            sampled = self.model_runner.execute_model(scheduler_output)
        progressed = self.scheduler.update_from_output(scheduler_output, sampled)
        self._record_stats(scheduler_output)
        return self._make_outputs(progressed)

    def _record_stats(self, scheduler_output: SchedulerOutput) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.num_batched_tokens.append(scheduler_output.num_batched_tokens)
        stats.trace.append(scheduler_output.trace())
        stats.num_preemptions = self.scheduler.num_preemptions
        prefix_stats = self.kv_cache_manager.prefix_cache_stats
        stats.prefix_cache_queries = prefix_stats.num_queried_tokens
        stats.prefix_cache_hits = prefix_stats.num_hit_tokens
        stats.kv_cache_usage_perc = self.kv_cache_manager.usage
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)

    def _make_outputs(self, progressed: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per prompt that got a new token or was aborted since the last step."""
        groups, self.aborted = self.aborted, []
        for seq in progressed:
            group = self.group_of_seq[seq.request_id]
            if group not in groups:
                groups.append(group)
        outputs = [make_request_output(group) for group in groups]
        for group in groups:
            if group.finished:
                self._forget(group)
        return outputs

    def _forget(self, group: RequestGroup) -> None:
        """A finished prompt's id may be used again."""
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            self.group_of_seq.pop(seq.request_id, None)


def make_request_output(group: RequestGroup) -> RequestOutput:
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=[make_completion_output(seq) for seq in group.seqs],
        finished=group.finished,
        metrics=group.seqs[0].metrics,
    )
