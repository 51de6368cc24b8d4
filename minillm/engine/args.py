"""`EngineArgs`: the engine's options (vLLM's names), their defaults, and the KV-cache sizing.

Options are checked twice, each check once: what can be judged from the options alone when
`EngineArgs` is made (before a model is loaded), and what needs the model (max_model_len
against the model's limit, the pool against one sequence) in `resolve`, before any memory is
allocated. Either way a bad option is a ValueError that names it and says what would work.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from minillm.core.kv_cache_manager import PREFIX_CACHING_ALGOS
from minillm.core.scheduler import check_scheduler_options
from minillm.distributed.disaggregation import KVTransferConfig
from minillm.distributed.parallel_state import ParallelConfig, max_world_size
from minillm.model.config import ModelConfig
from minillm.model.kv_cache_dtype import check_kv_cache_dtype, kv_cache_torch_dtype
from minillm.model.loader import DEFAULT_MODEL
from minillm.sampling_params import LOGPROBS_MODES, MAX_SEED, MIN_SEED
from minillm.spec.config import SpeculativeConfig

# max_model_len defaults to the model's limit, but at most this: a CPU pool for 40k-token
# contexts (Qwen3) would be gigabytes
DEFAULT_MAX_MODEL_LEN = 4096
# a pool sized from max_num_seqs * max_model_len / 2 stays under this unless asked otherwise
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 32


@dataclass(slots=True)
class EngineArgs:
    """Engine options (vLLM's names). None means: derive a default from the model."""

    model: str | os.PathLike = DEFAULT_MODEL
    dtype: str | None = None  # None: the checkpoint's torch_dtype
    device: str | None = None  # None: "cuda" when available, else "cpu"
    block_size: int = 16
    # None: 32, or the token budget when that is smaller (each seat needs a token a step)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # None: 2048, raised to max_model_len without chunks
    max_model_len: int | None = None  # None: max_position_embeddings, at most 4096
    enable_prefix_caching: bool = True
    # "hash": vLLM's chained block hashes; "radix": SGLang's radix tree over token ids
    prefix_caching_algo: str = "hash"
    enable_chunked_prefill: bool = True
    num_gpu_blocks: int | None = None  # KV-cache pool size in blocks ...
    kv_cache_memory_bytes: int | None = None  # ... or as a memory budget; default: see num_blocks
    # on CUDA without either of the two above: the share of the device's memory the engine may
    # fill, weights and activations included; the KV cache gets what is left (vLLM's rule)
    gpu_memory_utilization: float = 0.9
    attention_backend: str | None = None  # None: "triton" on CUDA, "torch" on the CPU
    enforce_eager: bool = False  # True: no CUDA graphs (GPU) or traced forward (CPU) for decode
    seed: int = 0  # seeds the generator that rows without their own seed share
    scheduling_policy: str = "fcfs"  # the waiting queue's order: "fcfs", "priority" or "sjf"
    batching_type: str = "continuous"  # or "static": a new batch only when the last one is done
    stats_window: int = 1024  # steps of per-step statistics kept (a bounded window)
    # weights quantized after loading (vLLM's option): "int8" (W8A16), "int4" (W4A16, group-wise),
    # "fp8" (E4M3 weights, weight-only) or "w8a8" (int8 weights and per-token int8 activations);
    # None: as the checkpoint stores them (GPTQ/AWQ are read as such)
    quantization: str | None = None
    quantization_group_size: int = 128  # int4: input channels per scale and zero point
    # how integer codes are chosen: "rtn", "gptq" or "awq"; for w8a8 "rtn" or "smoothquant"
    quantization_method: str = "rtn"
    # the KV cache's storage (vLLM's CacheConfig.cache_dtype): "auto" is the model's dtype;
    # "fp8_e4m3" (alias "fp8") one byte per element with per-layer k_scale and v_scale
    # (minillm.model.kv_cache_dtype), on the torch attention backend
    kv_cache_dtype: str = "auto"
    # fp8 only: calibrate k_scale and v_scale on the first forward (vLLM's option), else 1.0
    calculate_kv_scales: bool = False
    # one prompt's logits bitwise the same alone or in any batch, at a cost in speed (what
    # vLLM calls VLLM_BATCH_INVARIANT=1): fixed reduction order on the torch backend
    # (minillm.model.batch_invariant)
    batch_invariant: bool = False
    # what logprobs report (vLLM's option): "raw_logprobs" (the model's, before any processing),
    # "raw_logits", "processed_logprobs" or "processed_logits" (after masks, penalties,
    # temperature and top-k/top-p/min-p: what the token is drawn from)
    logprobs_mode: str = "raw_logprobs"
    # constrained decoding: append the text a grammar forces without a forward per token.
    # Off by default, as in SGLang: the forced text is tokenized as one run, not as the model
    # would split it, so the tokens (and the greedy text after them) can differ from decoding
    # token by token; on, it trades that fidelity for fewer forwards
    enable_jump_forward: bool = False
    # multi-LoRA serving (vLLM's options; minillm.model.lora): requests name an adapter with
    # a LoRARequest; a step's batch uses at most max_loras adapters, each of rank <=
    # max_lora_rank; max_cpu_loras adapters stay loaded (None: max_loras), the least recently
    # used one that no unfinished request needs making room for a new one (when every one is
    # needed, add_request raises LoRASlotsBusy; LLM.generate holds such requests back)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # model parallelism over worker processes the engine spawns (minillm.distributed)
    tensor_parallel_size: int = 1  # heads, MLP width and vocabulary split over this many ranks
    pipeline_parallel_size: int = 1  # layers split into this many stages
    # micro-batches a step's batch is cut into for the pipeline; None: pipeline_parallel_size
    pipeline_micro_batches: int | None = None
    # keep this many batches of different requests in flight across steps instead (vLLM V1
    # keeps pipeline_parallel_size): a step's batch is one micro-batch, and the first stage
    # takes the next batch while later stages finish the earlier ones (LLMEngine.step)
    pipeline_batches_in_flight: int | None = None
    # layers per stage, first to last, as "4,2" or (4, 2) (vLLM's VLLM_PP_LAYER_PARTITION):
    # a last stage that also computes the logits and samples can hold fewer; None: equal
    # shares, the first stages one more
    pipeline_layer_partition: str | tuple[int, ...] | None = None
    # a mixture-of-experts model's experts spread whole over the tensor-parallel ranks, tokens
    # sent to them with all-to-all (vLLM's option; minillm.distributed.expert_parallel)
    enable_expert_parallel: bool = False
    # prefill/decode disaggregation (vLLM's KVTransferConfig names): {"kv_connector":
    # "TorchDistributedConnector"} runs prompts on a prefill process and decode steps on a
    # decode process, moving each request's KV blocks between them; prefix caching is then off
    # (minillm.distributed.disaggregation)
    kv_transfer_config: dict | KVTransferConfig | None = None
    # speculative decoding, vLLM's dict: {"method": "draft_model" | "ngram", "model": ...,
    # "num_speculative_tokens": k, "prompt_lookup_min": ..., "prompt_lookup_max": ...}
    speculative_config: dict | SpeculativeConfig | None = None
    # vLLM's async_scheduling (overlap scheduling): plan step n + 1 while step n's forward runs
    # in a worker thread, with placeholders for step n's tokens (LLMEngine._step_async)
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs is None:
            budget = self.max_num_batched_tokens
            fits = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, budget) if fits else DEFAULT_MAX_NUM_SEQS
        for name in ("block_size", "max_num_seqs", "stats_window"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("max_num_batched_tokens", "max_model_len", "num_gpu_blocks"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=0)
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be an int in [{MIN_SEED}, {MAX_SEED}], got {self.seed!r}")
        if self.num_gpu_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_gpu_blocks or kv_cache_memory_bytes, not both")
        _check_kv_cache_and_invariance(self)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _check_async_scheduling(self)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if self.logprobs_mode != "raw_logprobs" and (
            self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1
        ):
            raise ValueError(
                f"logprobs_mode={self.logprobs_mode!r} runs on one process; it cannot be "
                "combined with tensor_parallel_size or pipeline_parallel_size > 1"
            )
        if not isinstance(self.enable_jump_forward, bool):
            raise ValueError(
                f"enable_jump_forward must be True or False, got {self.enable_jump_forward!r}"
            )
        if self.prefix_caching_algo not in PREFIX_CACHING_ALGOS:
            raise ValueError(
                f"prefix_caching_algo must be one of {PREFIX_CACHING_ALGOS}, "
                f"got {self.prefix_caching_algo!r}"
            )
        utilization = self.gpu_memory_utilization
        if (
            isinstance(utilization, bool)
            or not isinstance(utilization, (int, float))
            or not (0 < utilization <= 1)
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if self.quantization is not None:
            # imported here: the quantized layers load triton, which other engines never need
            from minillm.model.quantization import check_quantization_args

            check_quantization_args(
                self.quantization, self.quantization_group_size, self.quantization_method
            )
        elif (self.quantization_method, self.quantization_group_size) != ("rtn", 128):
            raise ValueError(
                "quantization_method and quantization_group_size apply only with quantization"
            )
        self.pipeline_layer_partition = _parse_partition(self.pipeline_layer_partition)
        if self.pipeline_layer_partition is not None and self.pipeline_parallel_size == 1:
            raise ValueError(
                "pipeline_layer_partition applies only with pipeline_parallel_size > 1"
            )
        self.parallel_config().check_options(max_world_size(self.device_type()), self.device_type())
        if self.pipeline_micro_batches is not None:
            _check_int("pipeline_micro_batches", self.pipeline_micro_batches, minimum=1)
            if self.pipeline_parallel_size == 1:
                raise ValueError(
                    "pipeline_micro_batches applies only with pipeline_parallel_size > 1"
                )
        if self.pipeline_batches_in_flight is not None:
            _check_int("pipeline_batches_in_flight", self.pipeline_batches_in_flight, minimum=1)
            if self.pipeline_parallel_size == 1:
                raise ValueError(
                    "pipeline_batches_in_flight applies only with pipeline_parallel_size > 1"
                )
            if self.pipeline_micro_batches is not None:
                raise ValueError(
                    "pipeline_micro_batches (each step cut and drained) and "
                    "pipeline_batches_in_flight (batches kept in flight across steps) exclude "
                    "each other"
                )
        if self.kv_transfer_config is not None:
            self._check_kv_transfer()
        _check_lora(self)
        if self.quantization is not None and self.parallel_config().world_size > 1:
            raise ValueError(
                "quantization runs on one process; it cannot be combined with "
                "tensor_parallel_size or pipeline_parallel_size > 1"
            )
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
            if self.parallel_config().world_size > 1:
                raise ValueError(
                    "speculative_config runs on one process; it cannot be combined with "
                    "tensor_parallel_size or pipeline_parallel_size > 1"
                )
        # the scheduler's own rules, with the defaults a model does not change
        check_scheduler_options(
            self.max_num_seqs,
            self.max_num_batched_tokens or max(self.max_num_seqs, DEFAULT_MAX_NUM_BATCHED_TOKENS),
            1,
            True,
            self.scheduling_policy,
            self.batching_type,
        )

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV-cache tensors are allocated in."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, model_dtype)

    def _check_kv_transfer(self) -> None:
        """Disaggregation: one prefill and one decode process, each with the whole model."""
        self.kv_transfer_config = KVTransferConfig.from_value(self.kv_transfer_config)
        if self.parallel_config().world_size > 1:
            raise ValueError(
                "kv_transfer_config runs one prefill and one decode process; it cannot be "
                "combined with tensor_parallel_size or pipeline_parallel_size > 1"
            )
        for name in ("speculative_config", "quantization"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} cannot be combined with kv_transfer_config")
        allowed = max_world_size(self.device_type())
        if allowed < 2:
            raise ValueError(
                "kv_transfer_config needs 2 processes (prefill and decode), but this machine "
                f"allows at most {allowed} on {self.device_type()}"
            )
        self.enable_prefix_caching = False  # a cached block may live on the other process

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.enable_expert_parallel,
            self.pipeline_layer_partition,
        )

    def device_type(self) -> str:
        """ "cuda" or "cpu" (or what `device` names): where the engine will run."""
        if self.device is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        return str(self.device).split(":")[0]

    def resolve_speculative_config(
        self, config: ModelConfig, max_model_len: int
    ) -> SpeculativeConfig | None:
        """The speculative config checked against the target: the draft's vocabulary must be
        the target's, and its context must hold max_model_len tokens."""
        spec = self.speculative_config
        if spec is None:
            return None
        spec.check_draft_config(config.vocab_size, max_model_len)
        return spec

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
            return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs, max_model_len)

    def num_blocks(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_model_len: int,
        available_bytes: int | None = None,
    ) -> int:
        """KV-cache blocks: num_gpu_blocks, or what kv_cache_memory_bytes holds, or what
        `available_bytes` holds (on CUDA: gpu_memory_utilization's share left after the
        weights and a warm-up forward), or by default room for max_num_seqs sequences half as
        long as max_model_len, at least one whole sequence, at most 1 GiB unless one sequence
        needs more.

        Refuses, before anything is allocated, a pool that cannot hold one sequence of
        max_model_len tokens (it could never finish) and one larger than the memory there is.
        """
        block_bytes = kv_cache_block_bytes(config, self.block_size, dtype)
        min_blocks = math.ceil(max_model_len / self.block_size)
        if self.num_gpu_blocks is not None:
            num_blocks = self.num_gpu_blocks
        elif self.kv_cache_memory_bytes is not None:
            num_blocks = self.kv_cache_memory_bytes // block_bytes
        elif available_bytes is not None:
            num_blocks = available_bytes // block_bytes
        else:
            num_tokens = self.max_num_seqs * max_model_len // 2
            budget_bytes = min(
                num_tokens * block_bytes // self.block_size, DEFAULT_KV_CACHE_MEMORY_BYTES
            )
            num_blocks = max(budget_bytes // block_bytes, min_blocks)
        if num_blocks < min_blocks:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {self.block_size} tokens, "
                f"{num_blocks * block_bytes:,} bytes) cannot hold one sequence of "
                f"max_model_len={max_model_len} tokens; give at least {min_blocks} blocks "
                f"({min_blocks * block_bytes:,} bytes) or a smaller max_model_len"
            )
        return num_blocks


def kv_cache_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: block_size tokens of keys and values in every layer."""
    return block_size * config.kv_bytes_per_token(dtype.itemsize)


def check_pool_fits(num_blocks: int, block_bytes: int, device: torch.device) -> None:
    """Refuse a pool larger than the memory the device has free, before allocating it."""
    free_bytes = device_free_bytes(device)
    pool_bytes = num_blocks * block_bytes
    if free_bytes is not None and pool_bytes > free_bytes:
        raise ValueError(
            f"a KV cache of {num_blocks:,} blocks needs {pool_bytes:,} bytes, but the "
            f"{device.type} has {free_bytes:,} bytes free; ask for fewer blocks"
        )


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory: what CUDA reports for a GPU; available physical memory for the CPU."""
    if device.type == "cuda":
        free_bytes, _total = torch.cuda.mem_get_info(device)
        return free_bytes
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None  # not a POSIX system: no limit known


def _check_lora(args: EngineArgs) -> None:
    """enable_lora applies the adapters inside one process's model runner."""
    if not isinstance(args.enable_lora, bool):
        raise ValueError(f"enable_lora must be True or False, got {args.enable_lora!r}")
    _check_int("max_loras", args.max_loras, minimum=1)
    _check_int("max_lora_rank", args.max_lora_rank, minimum=1)
    if args.max_cpu_loras is not None:
        _check_int("max_cpu_loras", args.max_cpu_loras, minimum=1)
        if args.max_cpu_loras < args.max_loras:
            raise ValueError(
                f"max_cpu_loras ({args.max_cpu_loras}) must be >= max_loras ({args.max_loras}): "
                "a batch's adapters must all be loaded"
            )
    if not args.enable_lora:
        return
    for name in ("speculative_config", "kv_transfer_config", "quantization"):
        if getattr(args, name) is not None:
            raise ValueError(f"enable_lora=True cannot be combined with {name}")
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        raise ValueError(
            "enable_lora=True runs on one process; it cannot be combined with "
            "tensor_parallel_size or pipeline_parallel_size > 1"
        )


def _check_kv_cache_and_invariance(args: EngineArgs) -> None:
    """kv_cache_dtype, calculate_kv_scales and batch_invariant, and the backend they need."""
    check_kv_cache_dtype(args.kv_cache_dtype)
    for name in ("calculate_kv_scales", "batch_invariant"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(args, name)!r}")
    fp8 = args.kv_cache_dtype != "auto"
    if args.calculate_kv_scales and not fp8:
        raise ValueError("calculate_kv_scales applies only with kv_cache_dtype='fp8_e4m3'")
    for name, on in (("kv_cache_dtype", fp8), ("batch_invariant", args.batch_invariant)):
        if on and args.attention_backend not in (None, "torch"):
            raise ValueError(
                f"{name} runs on the torch attention backend, got "
                f"attention_backend={args.attention_backend!r}"
            )
        if on and (args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1):
            raise ValueError(
                f"{name} runs on one process; it cannot be combined with "
                "tensor_parallel_size or pipeline_parallel_size > 1"
            )
    if args.batch_invariant and args.quantization is not None:
        raise ValueError("batch_invariant=True needs float weights; it cannot use quantization")


def _check_async_scheduling(args: EngineArgs) -> None:
    """async_scheduling overlaps one process's forward with its planning and output
    processing; it is not built for the step loops of speculative decoding or of worker
    processes."""
    if not isinstance(args.async_scheduling, bool):
        raise ValueError(f"async_scheduling must be True or False, got {args.async_scheduling!r}")
    if not args.async_scheduling:
        return
    for name in ("speculative_config", "kv_transfer_config"):
        if getattr(args, name) is not None:
            raise ValueError(f"async_scheduling=True cannot be combined with {name}")
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        raise ValueError(
            "async_scheduling=True runs on one process; it cannot be combined with "
            "tensor_parallel_size or pipeline_parallel_size > 1"
        )


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _parse_partition(partition: object) -> object:
    """pipeline_layer_partition as a tuple: "4,2" (vLLM's environment variable's form) or a
    list become (4, 2); anything else is left for ParallelConfig to judge."""
    if isinstance(partition, str):
        try:
            return tuple(int(part) for part in partition.split(","))
        except ValueError:
            raise ValueError(
                "pipeline_layer_partition must be layers per stage separated by commas, as "
                f'"4,2", got {partition!r}'
            ) from None
    return tuple(partition) if isinstance(partition, list) else partition
