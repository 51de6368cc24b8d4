"""Building an engine's parts from its EngineArgs: the KV pool, the scheduler, the runner.

`LLMEngine.__init__` reads as a list of parts; the decisions behind them are here:

- `size_kv_pool`: how many KV blocks the pool holds. Given outright (`num_gpu_blocks`,
  `kv_cache_memory_bytes`), or vLLM's sizing on a GPU: the device's memory times
  gpu_memory_utilization, less the weights, the peak of a warm-up forward over a full token
  budget and the decode CUDA graphs' pool; a draft model's cache takes its share of the same
  budget, block for block.
- `build_scheduler`: the KV-cache manager over that pool and the scheduler over both.
- `build_runners`: what runs each step's forward and sampling. A `ModelRunner` in this process,
  or a `MultiprocExecutor` over worker processes (tensor or pipeline parallelism, or a
  disaggregated prefill/decode pair), with `SpecDecodeRunner` around it when speculative
  decoding is on.

The model itself is loaded (and quantized) by `minillm.model.loader` and the functions at the
end of this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.scheduler import Scheduler
from minillm.distributed.executor import MultiprocExecutor
from minillm.distributed.parallel_state import free_port
from minillm.distributed.worker import WorkerSpec
from minillm.engine.args import EngineArgs, check_pool_fits, device_free_bytes, kv_cache_block_bytes
from minillm.model.config import torch_dtype
from minillm.model.loader import load_model
from minillm.model.lora import LoRAManager
from minillm.spec.config import SpeculativeConfig
from minillm.spec.spec_runner import SpecDecodeRunner
from minillm.structured.grammar import StructuredOutputManager
from minillm.worker.cuda_graphs import CUDA_GRAPH_BACKENDS, CUDAGraphConfig, profile_graph_bytes
from minillm.worker.model_runner import ModelRunner, profile_peak_bytes
from minillm.worker.sampler import Sampler


def attention_backend(args: EngineArgs, device: torch.device) -> str:
    """The attention backend: as asked, else Triton on CUDA and torch elsewhere; FP8 KV and
    batch-invariant execution have only the torch backend."""
    backend = args.attention_backend or ("triton" if device.type == "cuda" else "torch")
    if args.kv_cache_dtype != "auto" or args.batch_invariant:
        backend = "torch"  # their only backend (EngineArgs refuses any other by name)
    return backend


@dataclass(frozen=True, slots=True)
class KVPool:
    """The KV pool's size: blocks, bytes per block (the draft's included), element dtype."""

    num_blocks: int
    block_bytes: int
    dtype: torch.dtype


def size_kv_pool(
    args: EngineArgs,
    loaded,
    device: torch.device,
    backend: str,
    max_model_len: int,
    max_num_batched_tokens: int,
    spec_config: SpeculativeConfig | None,
    distributed: bool,
) -> KVPool:
    """How many blocks the KV pool holds (see the module docstring); ValueError when they do
    not fit on the device. loaded: the target model, as `load_model` returned it."""
    config = loaded.config
    dtype = args.kv_cache_torch_dtype(torch_dtype(config.torch_dtype))
    block_bytes = kv_cache_block_bytes(config, args.block_size, dtype)
    available_bytes = None
    if (
        device.type == "cuda"
        and not distributed
        and args.num_gpu_blocks is None
        and args.kv_cache_memory_bytes is None
    ):
        available_bytes = gpu_kv_cache_bytes(
            loaded.model, args.gpu_memory_utilization, max_num_batched_tokens
        )
        if not args.enforce_eager and backend in CUDA_GRAPH_BACKENDS:
            # the decode graphs' memory pool stays allocated beside the KV cache
            available_bytes = max(
                0,
                available_bytes
                - profile_graph_bytes(
                    loaded.model,
                    args.block_size,
                    CUDAGraphConfig(args.max_num_seqs, max_model_len),
                ),
            )
    if spec_config is not None and spec_config.method == "draft_model":
        # the draft's KV cache has as many blocks as the target's: both share the budget
        draft_config = load_model(spec_config.model, weights=False).config
        draft_block_bytes = kv_cache_block_bytes(
            draft_config, args.block_size, torch_dtype(args.dtype or draft_config.torch_dtype)
        )
        if available_bytes is not None:
            available_bytes = available_bytes * block_bytes // (block_bytes + draft_block_bytes)
        block_bytes += draft_block_bytes
    num_blocks = args.num_blocks(config, dtype, max_model_len, available_bytes)
    check_pool_fits(num_blocks, block_bytes, device)
    return KVPool(num_blocks, block_bytes, dtype)


def build_scheduler(
    args: EngineArgs,
    num_blocks: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    spec_config: SpeculativeConfig | None,
    clock: Callable[[], float],
) -> tuple[KVCacheManager, Scheduler]:
    """The KV pool's manager and the scheduler that plans every step over it."""
    kv_cache_manager = KVCacheManager(
        num_blocks, args.block_size, args.enable_prefix_caching, args.prefix_caching_algo
    )
    scheduler = Scheduler(
        kv_cache_manager,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        clock=clock,
        scheduling_policy=args.scheduling_policy,
        batching_type=args.batching_type,
        num_lookahead_tokens=spec_config.num_speculative_tokens if spec_config else 0,
        max_loras=args.max_loras if args.enable_lora else None,
        remote_prefill=args.kv_transfer_config is not None,
    )
    return kv_cache_manager, scheduler


def build_executor(
    args: EngineArgs, loaded, device: torch.device, backend: str, parallel, num_blocks: int
) -> MultiprocExecutor:
    """The worker processes that load the weights and run each step (tensor or pipeline
    parallelism, or one side of disaggregated prefill and decode)."""
    parallel.check_model(loaded.config)
    return MultiprocExecutor(
        WorkerSpec(
            model=str(loaded.path),
            dtype=loaded.config.torch_dtype,
            device_type=device.type,
            attention_backend=backend,
            parallel=parallel,
            num_blocks=num_blocks,
            block_size=args.block_size,
            seed=args.seed,
            # batches in flight: each batch is one micro-batch
            num_micro_batches=1
            if args.pipeline_batches_in_flight
            else args.pipeline_micro_batches or parallel.pipeline_parallel_size,
            port=free_port(),
            batches_in_flight=bool(args.pipeline_batches_in_flight),
            kv_transfer=args.kv_transfer_config,
        )
    )


def build_model_runner(
    args: EngineArgs,
    loaded,
    device: torch.device,
    backend: str,
    max_model_len: int,
    pool: KVPool,
    structured_output_manager: StructuredOutputManager,
    lora_manager: LoRAManager | None,
) -> ModelRunner:
    """The model runner of a single-process engine, with its sampler and KV cache."""
    sampler = Sampler(
        torch.Generator(device).manual_seed(args.seed),
        structured_output_manager,
        args.logprobs_mode,
    )
    # decode steps replay CUDA graphs unless told not to or the backend cannot be captured
    use_graphs = device.type == "cuda" and not args.enforce_eager and backend in CUDA_GRAPH_BACKENDS
    # on a CPU, their counterpart: decode steps replay a traced forward
    trace_decode = device.type == "cpu" and not args.enforce_eager and not args.batch_invariant
    return ModelRunner(
        loaded.model,
        sampler,
        pool.num_blocks,
        args.block_size,
        CUDAGraphConfig(args.max_num_seqs, max_model_len) if use_graphs else None,
        kv_cache_dtype=pool.dtype,
        lora_manager=lora_manager,
        trace_decode=trace_decode,
    )


def build_spec_runner(
    args: EngineArgs,
    target,
    spec_config: SpeculativeConfig,
    device: torch.device,
    backend: str,
    max_model_len: int,
    num_blocks: int,
) -> SpecDecodeRunner:
    """Speculative decoding around the target's runner (loading the draft model, if any)."""
    draft = None
    if spec_config.method == "draft_model":
        draft = load_model(spec_config.model, args.dtype, device, backend).model
    return SpecDecodeRunner(target, spec_config, max_model_len, draft, num_blocks)


def build_runners(
    args: EngineArgs,
    loaded,
    device: torch.device,
    backend: str,
    parallel,
    max_model_len: int,
    pool: KVPool,
    spec_config: SpeculativeConfig | None,
    structured_output_manager: StructuredOutputManager,
    lora_manager: LoRAManager | None,
) -> tuple[MultiprocExecutor | None, ModelRunner | MultiprocExecutor, SpecDecodeRunner | None]:
    """(executor, model runner, spec runner): the worker processes' executor when `parallel`
    is given (and then it is also the model runner), else a ModelRunner in this process; and
    speculative decoding around it when spec_config is given."""
    executor = None
    if parallel is not None:
        executor = build_executor(args, loaded, device, backend, parallel, pool.num_blocks)
        model_runner = executor
    else:
        model_runner = build_model_runner(
            args,
            loaded,
            torch.device(device),
            backend,
            max_model_len,
            pool,
            structured_output_manager,
            lora_manager,
        )
    spec_runner = None
    if spec_config is not None:
        spec_runner = build_spec_runner(
            args, model_runner, spec_config, device, backend, max_model_len, pool.num_blocks
        )
    return executor, model_runner, spec_runner


def quantize_loaded_model(loaded, args: EngineArgs) -> None:
    """Quantize the freshly loaded model's decoder linears in place (`args.quantization`);
    GPTQ and AWQ calibrate on standard library text that is not held out. The float weights
    they replace are freed before the KV cache is sized, so a smaller model leaves more room
    for the cache."""
    from minillm.model.quantization import default_calibration, quantize_model

    calibration = None
    if args.quantization_method != "rtn":
        calibration = default_calibration(loaded.path)
    quantize_model(
        loaded.model,
        args.quantization,
        args.quantization_group_size,
        args.quantization_method,
        calibration,
    )
    if loaded.model.lm_head.weight.is_cuda:
        torch.cuda.empty_cache()


def configure_attention(model, args: EngineArgs) -> None:
    """The options that change how attention runs: FP8 KV-cache scales to calibrate on the
    first forward (`calculate_kv_scales`) and batch-invariant execution."""
    if model is None:
        return
    if args.calculate_kv_scales:
        for layer in model.model.layers:
            layer.self_attn.backend.calculate_kv_scales = True
    if args.batch_invariant:
        from minillm.model.batch_invariant import enable_batch_invariant

        enable_batch_invariant(model)


def gpu_kv_cache_bytes(model, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
    """vLLM's sizing: the device's memory times gpu_memory_utilization, less what the weights
    and the peak of a warm-up forward over a full token budget take; the KV cache gets the
    rest."""
    device = model.lm_head.weight.device
    _free, total_bytes = torch.cuda.mem_get_info(device)
    peak_bytes = profile_peak_bytes(model, max_num_batched_tokens)
    available = int(total_bytes * gpu_memory_utilization) - peak_bytes
    free_bytes = device_free_bytes(device) or 0
    return max(0, min(available, free_bytes))
