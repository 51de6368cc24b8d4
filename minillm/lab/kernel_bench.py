"""Kernel benchmarks: every Triton kernel beside its PyTorch baseline, placed on the roofline.

For each case and implementation: the median time of `triton.testing.do_bench` (which
flushes the L2 cache between runs), the bytes and FLOPs that the kernel module's cost
functions count for the work, the achieved GB/s and TFLOP/s, and their share of the
device's datasheet peaks (`minillm.lab.hardware`). `roofline_pct` is the fastest time the
roofline allows, max(bytes / bandwidth, FLOPs / peak), over the measured time: 100 means
the hardware could not go faster. A baseline is credited with the same useful work, so the
percentages compare like with like.

Baselines run in the same process on the same inputs: the engine's eager PyTorch RMSNorm
and RoPE, `scaled_dot_product_attention` (its FlashAttention backend for prefill, the
default backend over a contiguous KV cache for decode), and for the quantized matmuls both
the bfloat16 matmul they must beat and dequantize-then-matmul. A last table times a decode
step of a Qwen3-0.6B-shaped model (random weights) with and without CUDA graphs.

    python -m minillm.lab.kernel_bench [--quick] [--out benchmarks/results]

run from the repository root, writes benchmarks/results/kernels_<device>.json (device,
spec used, versions, date, every measurement, and the three goals below). It needs a CUDA
GPU. Goals, measured and reported, never asserted: decode attention >= 70% of HBM
bandwidth at batch 64 x 4k context; prefill attention within 1.5x of SDPA's
FlashAttention; W4A16 at batch 1 faster than the bfloat16 matmul. Chapter 5 shows the
results, and on a GPU runs a few cases live through `run`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import pathlib
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from minillm.lab.hardware import DEVICES, DeviceSpec

DTYPE = torch.bfloat16  # float16 on GPUs without bfloat16 (set in main)
# Llama 3.1 8B attention: 32 query heads on 8 KV heads of 128
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE = 16
DEVICE = "cuda"  # the sweeps' tests run them under the interpreter, on "cpu"

# torch.cuda.get_device_name() pattern -> spec table row. PCIe, NVL and 40 GB parts have
# other clocks or bandwidths than the listed SXM ones: they are measured instead.
CUDA_NAME_TO_SPEC = (
    (r"\bH200\b", "H200 SXM"),
    (r"\bH100\b", "H100 SXM"),
    (r"\bA100\b", "A100 SXM 80GB"),
    (r"\bL40S\b", "L40S"),
    (r"\bL4\b", "L4"),
    (r"\bT4\b", "T4"),
    (r"\b4090\b", "RTX 4090"),
)
OTHER_VARIANTS = re.compile(r"PCIe|NVL|40GB", re.IGNORECASE)


def spec_for_cuda_name(name: str) -> DeviceSpec | None:
    """The datasheet row for a CUDA device name, or None when the table lacks its variant."""
    if OTHER_VARIANTS.search(name):
        return None
    for pattern, spec_name in CUDA_NAME_TO_SPEC:
        if re.search(pattern, name):
            return DEVICES[spec_name]
    return None


def device_slug(name: str) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3", for the results file name."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@dataclass(slots=True)
class Measurement:
    kernel: str
    case: str
    impl: str
    time_ms: float
    bytes: int
    flops: int
    gb_per_s: float
    tflop_per_s: float
    pct_of_bandwidth: float
    pct_of_peak_flops: float
    roofline_pct: float


class Bench:
    """Times callables and places them on the roofline of `spec`."""

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.measurements: list[Measurement] = []

    def run(
        self, kernel: str, case: str, impl: str, fn: Callable[[], object], bytes_: int, flops: int
    ) -> Measurement:
        import triton

        fn()  # compile and warm up outside the timing
        time_s = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
        bandwidth = self.spec.memory_bandwidth_bytes_per_s
        peak = self.spec.peak_flops(DTYPE)
        floor_s = max(bytes_ / bandwidth, flops / peak)
        m = Measurement(
            kernel=kernel,
            case=case,
            impl=impl,
            time_ms=time_s * 1e3,
            bytes=bytes_,
            flops=flops,
            gb_per_s=bytes_ / time_s / 1e9,
            tflop_per_s=flops / time_s / 1e12,
            pct_of_bandwidth=100 * bytes_ / time_s / bandwidth,
            pct_of_peak_flops=100 * flops / time_s / peak,
            roofline_pct=100 * floor_s / time_s,
        )
        self.measurements.append(m)
        print(
            f"{kernel:14s} {case:28s} {impl:30s} {m.time_ms:9.4f} ms {m.gb_per_s:8.1f} GB/s "
            f"{m.tflop_per_s:7.2f} TFLOP/s {m.pct_of_bandwidth:5.1f}% BW "
            f"{m.pct_of_peak_flops:5.1f}% FLOPs {m.roofline_pct:5.1f}% roofline",
            flush=True,
        )
        return m


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def bench_rmsnorm(bench: Bench, quick: bool) -> None:
    for rows, hidden in [(4096, 4096)] if quick else [(4096, 4096), (16384, 8192)]:
        rmsnorm_case(bench, rows, hidden)


def rmsnorm_case(bench: Bench, rows: int, hidden: int) -> None:
    from kernels.rmsnorm import rms_norm, rms_norm_bytes, rms_norm_flops
    from minillm.model.llama import RMSNorm

    x, residual, weight = randn(rows, hidden), randn(rows, hidden), randn(hidden)
    norm = RMSNorm(hidden, 1e-5).to("cuda", DTYPE)
    nbytes = rms_norm_bytes(rows, hidden, 2, residual=True)
    flops = rms_norm_flops(rows, hidden, residual=True)
    case = f"{rows}x{hidden} +residual"

    def triton_fused():
        return rms_norm(x, weight, 1e-5, residual)

    def torch_eager():
        return norm(x, residual)

    bench.run("rmsnorm", case, "triton fused", triton_fused, nbytes, flops)
    bench.run("rmsnorm", case, "torch eager", torch_eager, nbytes, flops)


def bench_rope(bench: Bench, quick: bool) -> None:
    for num_tokens in [4096] if quick else [4096, 16384]:
        rope_case(bench, num_tokens)


def rope_case(bench: Bench, num_tokens: int) -> None:
    from kernels.rope import apply_rope, rope_bytes, rope_cos_sin_cache, rope_flops
    from minillm.lab.catalog import get_model_config
    from minillm.model.rope import RotaryEmbedding
    from minillm.model.rope import apply_rope as torch_apply_rope

    config = get_model_config("Llama 3.1 8B")
    max_position = config.max_position_embeddings
    rotary = RotaryEmbedding(HEAD_DIM, config.rope_theta, config.rope_scaling)
    cache = rope_cos_sin_cache(rotary.inv_freq, max_position, "cuda")
    q, k = randn(num_tokens, NUM_HEADS, HEAD_DIM), randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, max_position, (num_tokens,), device=DEVICE)

    def triton_rope():
        return apply_rope(q, k, positions, cache)

    def torch_rope():
        cos, sin = rotary(positions, DTYPE)
        return torch_apply_rope(q, cos, sin), torch_apply_rope(k, cos, sin)

    nbytes = rope_bytes(num_tokens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)
    flops = rope_flops(num_tokens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    case = f"{num_tokens} tokens"
    bench.run("rope", case, "triton", triton_rope, nbytes, flops)
    bench.run("rope", case, "torch eager", torch_rope, nbytes, flops)


def sdpa_flash(q, k, v, **kwargs):
    """SDPA restricted to its FlashAttention backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)


def bench_prefill(bench: Bench, quick: bool) -> None:
    for batch, seq_len in [(4, 2048)] if quick else [(1, 8192), (4, 2048), (16, 512)]:
        prefill_case(bench, batch, seq_len)
    if not quick:
        chunked_prefill_case(bench, batch=4, prefix_len=4096, chunk=512)


def prefill_case(bench: Bench, batch: int, seq_len: int) -> None:
    from kernels.flash_attention import (
        flash_attention,
        flash_attention_bytes,
        flash_attention_flops,
    )

    scale = HEAD_DIM**-0.5
    num_tokens = batch * seq_len
    q = randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k, v = randn(num_tokens, NUM_KV_HEADS, HEAD_DIM), randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    cu_seqlens = torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * seq_len
    group = NUM_HEADS // NUM_KV_HEADS

    def to_sdpa(t: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """SDPA's layout [batch, heads, seq, d], KV heads repeated for its flash backend."""
        t = t.view(batch, seq_len, -1, HEAD_DIM).transpose(1, 2)
        return t.repeat_interleave(repeat, dim=1).contiguous()

    qs, ks, vs = to_sdpa(q), to_sdpa(k, group), to_sdpa(v, group)

    def triton_flash():
        return flash_attention(q, k, v, cu_seqlens, seq_len, scale)

    def torch_flash():
        return sdpa_flash(qs, ks, vs, is_causal=True, scale=scale)

    lens = [seq_len] * batch
    nbytes = flash_attention_bytes(lens, [0] * batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)
    flops = flash_attention_flops(lens, [0] * batch, NUM_HEADS, HEAD_DIM)
    case = f"{batch}x{seq_len} causal"
    bench.run("prefill", case, "triton flash", triton_flash, nbytes, flops)
    bench.run("prefill", case, "torch sdpa flash", torch_flash, nbytes, flops)


def chunked_prefill_case(bench: Bench, batch: int, prefix_len: int, chunk: int) -> None:
    """Chunks after a prefix in the paged cache (chunked prefill, prefix-cache hits)."""
    from kernels.flash_attention import (
        flash_attention,
        flash_attention_bytes,
        flash_attention_flops,
    )

    scale = HEAD_DIM**-0.5
    context = prefix_len + chunk
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    kv_cache = randn(2, batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_tables = torch.randperm(batch * blocks_per_seq, device=DEVICE).view(batch, -1).int()
    q = randn(batch * chunk, NUM_HEADS, HEAD_DIM)
    k, v = (
        randn(batch * chunk, NUM_KV_HEADS, HEAD_DIM),
        randn(batch * chunk, NUM_KV_HEADS, HEAD_DIM),
    )
    cu_seqlens = torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * chunk
    prefix_lens = torch.full((batch,), prefix_len, device=DEVICE, dtype=torch.int32)
    # the baseline attends over a contiguous copy of the context, with an explicit mask
    qs = q.view(batch, chunk, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    ks = randn(batch, NUM_KV_HEADS, context, HEAD_DIM)
    vs = randn(batch, NUM_KV_HEADS, context, HEAD_DIM)
    rows = torch.arange(chunk, device=DEVICE)[:, None] + prefix_len
    mask = torch.arange(context, device=DEVICE)[None, :] <= rows

    def triton_chunk():
        return flash_attention(
            q, k, v, cu_seqlens, chunk, scale, kv_cache, block_tables, prefix_lens
        )

    def torch_chunk():
        return torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
        )

    lens, prefixes = [chunk] * batch, [prefix_len] * batch
    nbytes = flash_attention_bytes(lens, prefixes, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)
    flops = flash_attention_flops(lens, prefixes, NUM_HEADS, HEAD_DIM)
    case = f"{batch}x{chunk} after {prefix_len}"
    bench.run("prefill", case, "triton flash, paged prefix", triton_chunk, nbytes, flops)
    bench.run("prefill", case, "torch sdpa, contiguous, mask", torch_chunk, nbytes, flops)


def bench_decode(bench: Bench, quick: bool) -> None:
    for batch, context in [(64, 4096)] if quick else [(1, 32768), (16, 8192), (64, 4096)]:
        decode_case(bench, batch, context)


def decode_case(bench: Bench, batch: int, context: int) -> None:
    from kernels.device import sm_count
    from kernels.paged_decode import (
        choose_num_splits,
        paged_decode_attention,
        paged_decode_bytes,
        paged_decode_flops,
    )

    scale = HEAD_DIM**-0.5
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    kv_cache = randn(2, batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_tables = torch.randperm(batch * blocks_per_seq, device=DEVICE).view(batch, -1).int()
    seq_lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
    q = randn(batch, NUM_HEADS, HEAD_DIM)
    # the baseline: the same attention over a contiguous cache (no block table)
    qs = q[:, :, None, :]
    ks = randn(batch, NUM_KV_HEADS, context, HEAD_DIM)
    vs = randn(batch, NUM_KV_HEADS, context, HEAD_DIM)

    def triton_decode(num_splits: int):
        return paged_decode_attention(
            q, kv_cache, block_tables, seq_lens, scale, context, num_splits
        )

    def torch_decode():
        return torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, scale=scale, enable_gqa=True
        )

    lens = [context] * batch
    nbytes = paged_decode_bytes(lens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)
    flops = paged_decode_flops(lens, NUM_HEADS, HEAD_DIM)
    case = f"{batch}x{context}"
    splits = choose_num_splits(batch, NUM_KV_HEADS, context, sm_count(q.device))
    # one split against the chosen count: what split-KV buys
    for num_splits in sorted({1, splits}):
        impl = f"triton paged, {num_splits} split(s)"
        bench.run("decode", case, impl, functools.partial(triton_decode, num_splits), nbytes, flops)
    bench.run("decode", case, "torch sdpa, contiguous KV", torch_decode, nbytes, flops)


def bench_quant_matmul(bench: Bench, quick: bool) -> None:
    shapes = [(4096, 4096)] if quick else [(4096, 4096), (14336, 4096), (4096, 14336)]
    for n, k in shapes:
        for m in [1, 16] if quick else [1, 4, 16, 256, 4096]:
            quant_matmul_case(bench, m, n, k)


def quant_matmul_case(bench: Bench, m: int, n: int, k: int) -> None:
    from kernels.quant_matmul import (
        dequantize_w4,
        quant_matmul_bytes,
        quant_matmul_flops,
        quantize_w4,
        quantize_w8,
        w4a16_matmul,
        w8a16_matmul,
    )

    weight = randn(n, k) * 0.02
    qweight, scales8 = quantize_w8(weight)
    packed, scales4 = quantize_w4(weight)
    x = randn(m, k)

    def triton_w4():
        return w4a16_matmul(x, packed, scales4)

    def triton_w8():
        return w8a16_matmul(x, qweight, scales8)

    def torch_matmul():
        return x @ weight.T

    def torch_dequant_matmul():
        return x @ dequantize_w4(packed, scales4, 128).to(DTYPE).T

    flops = quant_matmul_flops(m, n, k)
    w4_bytes = quant_matmul_bytes(m, n, k, 2, 4, 128)
    w8_bytes = quant_matmul_bytes(m, n, k, 2, 8, None)
    matmul_bytes = (m * k + m * n + n * k) * 2
    case = f"M={m} N={n} K={k}"
    bench.run("quant_matmul", case, "triton w4a16", triton_w4, w4_bytes, flops)
    bench.run("quant_matmul", case, "triton w8a16", triton_w8, w8_bytes, flops)
    bench.run("quant_matmul", case, "torch bf16 matmul", torch_matmul, matmul_bytes, flops)
    bench.run(
        "quant_matmul", case, "torch dequant w4 + matmul", torch_dequant_matmul, w4_bytes, flops
    )


# W4A16 decided shape by shape: the MLP up projection (hidden -> intermediate) of three model
# sizes, at the decode GEMV (M = 1) and a small-batch GEMM (M = 16), against the dense
# float16 matmul, symmetric and with zero points (what AWQ and GPTQ checkpoints carry)
W4A16_DECISION_MODELS = ("Qwen3-0.6B", "Llama 3.1 8B", "Llama 3.3 70B")
W4A16_DECISION_ROWS = (1, 16)


def bench_w4a16_decision(bench: Bench, quick: bool) -> None:
    from minillm.lab.catalog import get_model_config

    for model in W4A16_DECISION_MODELS:  # quick too: the decision needs every size
        config = get_model_config(model)
        for m in W4A16_DECISION_ROWS:
            w4a16_decision_case(bench, m, config.intermediate_size, config.hidden_size, model)


def w4a16_decision_case(bench: Bench, m: int, n: int, k: int, model: str) -> None:
    from kernels.quant_matmul import (
        quant_matmul_bytes,
        quant_matmul_flops,
        quantize_w4,
        w4a16_matmul,
    )

    dtype = torch.float16
    weight = torch.randn(n, k, device=DEVICE, dtype=dtype) * 0.02
    packed, scales = quantize_w4(weight)
    zeros = torch.randint(0, 16, scales.shape, device=DEVICE, dtype=torch.uint8)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    flops = quant_matmul_flops(m, n, k)
    w4_bytes = quant_matmul_bytes(m, n, k, 2, 4, 128)
    case = f"{model} up M={m} N={n} K={k}"
    bench.run(
        "w4a16 decision",
        case,
        "triton w4a16",
        lambda: w4a16_matmul(x, packed, scales),
        w4_bytes,
        flops,
    )
    bench.run(
        "w4a16 decision",
        case,
        "triton w4a16 zero points",
        lambda: w4a16_matmul(x, packed, scales, 128, zeros),
        w4_bytes + n * k // 128,
        flops,
    )
    bench.run(
        "w4a16 decision",
        case,
        "torch fp16 matmul",
        lambda: x @ weight.T,
        (m * k + m * n + n * k) * 2,
        flops,
    )


MIXED_STEP_MODEL = "Qwen3-0.6B"
# decode rows, their context, the prefill chunk's length and the prefix before it
MIXED_STEP_SHAPE = (31, 1024, 512, 512)


def bench_mixed_step(bench: Bench, quick: bool) -> None:
    """A forward step of a Qwen3-0.6B-shaped model (random weights, Triton attention) on a
    mixed batch, 31 decode rows at a 1k context beside one 512-token prefill chunk after a
    512-token prefix, and on each half alone: the mixed batch's split into the decode and
    prefill kernels, timed eager (mixed steps are not graphed). Bytes: the weights once;
    FLOPs: 2 per weight per token (attention left out)."""
    from minillm.lab.catalog import get_model_config
    from minillm.model.llama import LlamaForCausalLM

    config = get_model_config(MIXED_STEP_MODEL)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config, "triton").to(DTYPE).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = config.vocab_size * config.hidden_size
    num_weights = sum(p.numel() for p in model.parameters()) - embedding
    for case, (forward, num_tokens) in mixed_step_forwards(model, *MIXED_STEP_SHAPE).items():
        flops = 2 * num_weights * num_tokens
        bench.run("mixed step", case, "eager, triton", forward, weight_bytes, flops)


def mixed_step_forwards(
    model, decodes: int, context: int, chunk: int, prefix: int
) -> dict[str, tuple[Callable[[], torch.Tensor], int]]:
    """{case: (forward, number of tokens)} for the mixed batch (decode rows 0 .. decodes - 1,
    then the chunk) and each half alone. A sequence has the same tokens, positions and cache
    blocks in every batch, so its rows' outputs agree across them."""
    from minillm.model.attention import AttentionMetadata, split_mixed_batch
    from minillm.worker.model_runner import allocate_kv_caches

    config = model.config
    blocks_per_seq = math.ceil((max(context, prefix) + chunk) / BLOCK_SIZE)
    kv_caches = allocate_kv_caches(
        config, (decodes + 1) * blocks_per_seq + 1, BLOCK_SIZE, DTYPE, torch.device(DEVICE)
    )
    tables = torch.arange((decodes + 1) * blocks_per_seq, device=DEVICE).view(decodes + 1, -1)
    gen = torch.Generator().manual_seed(0)
    # each sequence's new tokens: (table row, new token ids, context before them)
    seqs = [
        (i, torch.randint(0, config.vocab_size, (1,), generator=gen), context)
        for i in range(decodes)
    ]
    seqs.append((decodes, torch.randint(0, config.vocab_size, (chunk,), generator=gen), prefix))

    def step(batch):
        query_lens = [len(ids) for _, ids, _ in batch]
        seq_lens = [len(ids) + c for _, ids, c in batch]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        positions = torch.cat([torch.arange(c, c + len(ids)) for _, ids, c in batch]).to(DEVICE)
        rows = torch.cat([torch.full((len(ids),), i) for i, ids, _ in batch]).to(DEVICE)
        slots = tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor(starts, device=DEVICE, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32),
            block_tables=tables[[i for i, _, _ in batch]].int(),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=BLOCK_SIZE,
            mixed=split_mixed_batch(starts, seq_lens, DEVICE),
        )
        ids = torch.cat([ids for _, ids, _ in batch]).to(DEVICE)

        def forward():
            with torch.inference_mode():
                return model(ids, positions, kv_caches, meta)

        return forward, starts[-1]

    return {
        f"mixed: {decodes} decodes + {chunk}-token chunk": step(seqs),
        f"decode only: {decodes} decodes": step(seqs[:-1]),
        f"prefill only: {chunk}-token chunk": step(seqs[-1:]),
    }


def bench_decode_step_graphs(quick: bool) -> list[dict]:
    """Decode-step forward time of a Qwen3-0.6B-shaped model, eager and replayed as a graph."""
    from minillm.lab.catalog import get_model_config
    from minillm.model.llama import LlamaForCausalLM
    from minillm.worker.cuda_graphs import CUDAGraphConfig, CUDAGraphRunner
    from minillm.worker.model_runner import allocate_kv_caches

    config = get_model_config("Qwen3-0.6B")
    context, max_batch = 1024, 64
    with torch.device("cuda"):
        model = LlamaForCausalLM(config, "triton").to(DTYPE).eval()
    blocks_per_seq = math.ceil((context + 1) / BLOCK_SIZE)
    kv_caches = allocate_kv_caches(
        config, max_batch * blocks_per_seq + 1, BLOCK_SIZE, DTYPE, torch.device("cuda")
    )
    graphs = CUDAGraphRunner(model, kv_caches, BLOCK_SIZE, CUDAGraphConfig(max_batch, 2 * context))
    return [
        decode_step_case(model, kv_caches, graphs, batch, context, blocks_per_seq)
        for batch in ([1, 32] if quick else [1, 8, 32, 64])
    ]


def decode_step_case(model, kv_caches, graphs, batch: int, context: int, blocks_per_seq: int):
    import triton

    from minillm.model.attention import AttentionMetadata

    tables = torch.arange(batch * blocks_per_seq, device=DEVICE).view(batch, -1)
    meta = AttentionMetadata(
        slot_mapping=tables[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE,
        query_start_loc=torch.arange(batch + 1, device=DEVICE, dtype=torch.int32),
        seq_lens=torch.full((batch,), context + 1, device=DEVICE, dtype=torch.int32),
        block_tables=tables.int(),
        max_query_len=1,
        max_seq_len=context + 1,
        block_size=BLOCK_SIZE,
    )
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=DEVICE)
    positions = torch.full((batch,), context, device=DEVICE)

    def eager():
        return model(ids, positions, kv_caches, meta)

    def replay():
        return graphs.run(ids, positions, meta)

    with torch.inference_mode():
        eager_ms = triton.testing.do_bench(eager, return_mode="median")
        graph_ms = triton.testing.do_bench(replay, return_mode="median")
    print(
        f"decode step    Qwen3-0.6B shape batch {batch:3d}  eager {eager_ms:8.3f} ms  "
        f"CUDA graph {graph_ms:8.3f} ms  speedup {eager_ms / graph_ms:5.2f}x",
        flush=True,
    )
    return {"batch": batch, "context": context, "eager_ms": eager_ms, "graph_ms": graph_ms}


def find(measurements: list[Measurement], kernel: str, case: str, impl: str) -> Measurement | None:
    for m in measurements:
        if m.kernel == kernel and m.case == case and m.impl.startswith(impl):
            return m
    return None


# the kernels' performance goals on an H100/H200 (chapter 5 quotes them from here)
DECODE_GOAL_PCT_OF_HBM = 70  # decode attention at batch 64 x 4k context
PREFILL_GOAL_TIME_OVER_SDPA = 1.5  # prefill attention vs SDPA's FlashAttention backend


def evaluate_goals(measurements: list[Measurement]) -> dict:
    """The three performance goals, from the measurements that bear on them."""
    decode = [
        m
        for m in measurements
        if m.kernel == "decode" and m.case == "64x4096" and "triton" in m.impl
    ]
    best_decode_pct = max((m.pct_of_bandwidth for m in decode), default=None)
    ratios = {}
    for m in measurements:
        if m.kernel == "prefill" and m.impl == "triton flash":
            baseline = find(measurements, "prefill", m.case, "torch sdpa flash")
            if baseline is not None:
                ratios[m.case] = m.time_ms / baseline.time_ms
    w4_vs_bf16 = {}
    for m in measurements:
        if m.kernel == "quant_matmul" and m.impl == "triton w4a16" and m.case.startswith("M=1 "):
            baseline = find(measurements, "quant_matmul", m.case, "torch bf16 matmul")
            w4_vs_bf16[m.case] = baseline.time_ms / m.time_ms
    w4_decision = {}
    for m in measurements:
        if m.kernel == "w4a16 decision" and m.impl.startswith("triton"):
            dense = find(measurements, "w4a16 decision", m.case, "torch fp16 matmul")
            if dense is not None:
                w4_decision.setdefault(m.case, {})[m.impl] = dense.time_ms / m.time_ms
    return {
        "w4a16_speedup_over_fp16_by_shape": w4_decision,
        "w4a16_faster_on_every_shape": bool(w4_decision)
        and min(min(v.values()) for v in w4_decision.values()) > 1,
        "decode_64x4096_pct_of_hbm": best_decode_pct,
        "decode_goal_met": best_decode_pct is not None
        and best_decode_pct >= DECODE_GOAL_PCT_OF_HBM,
        "prefill_time_over_sdpa_flash": ratios,
        "prefill_goal_met": bool(ratios) and max(ratios.values()) <= PREFILL_GOAL_TIME_OVER_SDPA,
        "w4a16_batch1_speedup_over_bf16": w4_vs_bf16,
        "w4a16_goal_met": bool(w4_vs_bf16) and min(w4_vs_bf16.values()) > 1,
    }


def versions() -> dict:
    import triton

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "minillm_commit": commit,
    }


KERNEL_BENCHMARKS = {
    "rmsnorm": bench_rmsnorm,
    "rope": bench_rope,
    "prefill": bench_prefill,
    "decode": bench_decode,
    "quant_matmul": bench_quant_matmul,
    "w4a16_decision": bench_w4a16_decision,
    "mixed_step": bench_mixed_step,
}


@contextlib.contextmanager
def forced(module, name: str, value) -> Iterator[None]:
    """Replace a launcher's configuration function (or constant) for the duration: the
    launcher then runs, with all its checks, in the configuration being swept."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


def sweep_prefill(bench: Bench, batch: int = 4, seq_len: int = 2048) -> list[dict]:
    """FlashAttention's tiles, warps and pipeline depth at 4 x 2048 (causal)."""
    from kernels import flash_attention as fa

    scale = HEAD_DIM**-0.5
    q = randn(batch * seq_len, NUM_HEADS, HEAD_DIM)
    k, v = (
        randn(batch * seq_len, NUM_KV_HEADS, HEAD_DIM),
        randn(batch * seq_len, NUM_KV_HEADS, HEAD_DIM),
    )
    cu_seqlens = torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * seq_len
    lens = [seq_len] * batch
    nbytes = fa.flash_attention_bytes(lens, [0] * batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)
    flops = fa.flash_attention_flops(lens, [0] * batch, NUM_HEADS, HEAD_DIM)
    shipped = fa._launch_config(HEAD_DIM, 2, q.device)
    reference = None
    rows = []
    for config in dict.fromkeys(
        [
            shipped,
            (128, 128, 8, 3),
            (128, 64, 4, 3),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (128, 64, 8, 4),
            (128, 32, 8, 3),
        ]
    ):
        with forced(fa, "_launch_config", lambda *args, config=config: config):

            def call():
                return fa.flash_attention(q, k, v, cu_seqlens, seq_len, scale)

            out = call()
            reference = out if reference is None else reference
            m = bench.run(
                "prefill sweep", f"{batch}x{seq_len} causal", f"tiles {config}", call, nbytes, flops
            )
        rows.append(
            {
                "config": list(config),
                "shipped": config == shipped,
                "time_ms": m.time_ms,
                "tflop_per_s": m.tflop_per_s,
                "max_abs_diff": max_abs_error(out, reference),
            }
        )
    return rows


def sweep_decode(bench: Bench, batch: int = 64, context: int = 4096) -> list[dict]:
    """The split-KV kernel's key tile, warps and pipeline depth at 64 x 4096, one split."""
    from kernels import paged_decode as pd

    scale = HEAD_DIM**-0.5
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    kv_cache = randn(2, batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_tables = torch.randperm(batch * blocks_per_seq, device=DEVICE).view(batch, -1).int()
    seq_lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
    q = randn(batch, NUM_HEADS, HEAD_DIM)
    nbytes = pd.paged_decode_bytes([context] * batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)
    flops = pd.paged_decode_flops([context] * batch, NUM_HEADS, HEAD_DIM)
    shipped = pd._launch_config(16, HEAD_DIM, 2, q.device)
    reference = None
    rows = []
    for config in dict.fromkeys(
        [
            shipped,
            (32, 4, 3),
            (64, 4, 2),
            (64, 4, 4),
            (128, 4, 3),
            (128, 8, 3),
            (64, 8, 3),
            (16, 4, 4),
        ]
    ):
        with forced(pd, "_launch_config", lambda *args, config=config: config):

            def call():
                return pd.paged_decode_attention(
                    q, kv_cache, block_tables, seq_lens, scale, context, 1
                )

            out = call()
            reference = out if reference is None else reference
            impl = f"BLOCK_N, warps, stages {config}"
            m = bench.run("decode sweep", f"{batch}x{context}", impl, call, nbytes, flops)
        rows.append(
            {
                "config": list(config),
                "shipped": config == shipped,
                "time_ms": m.time_ms,
                "pct_of_bandwidth": m.pct_of_bandwidth,
                "max_abs_diff": max_abs_error(out, reference),
            }
        )
    return rows


def sweep_w4a16_gemv(
    bench: Bench, shapes: tuple[tuple[int, int], ...] = ((4096, 4096), (14336, 4096))
) -> list[dict]:
    """The W4A16 GEMV at batch 1: rows per program, warps, pipeline depth, and split-K."""
    from kernels import quant_matmul as qm

    rows = []
    for n, k in shapes:
        weight = randn(n, k) * 0.02
        packed, scales = qm.quantize_w4(weight)
        x = randn(1, k)
        expected = qm.w4a16_matmul_reference(x, packed, scales, 128)
        nbytes = qm.quant_matmul_bytes(1, n, k, 2, 4, 128)
        flops = qm.quant_matmul_flops(1, n, k)
        shipped = qm.plan_quant_matmul(1, n, k, 2, 4, 128, x.device)
        configs = [
            (None, None),
            ((32, 4, 4), None),
            ((128, 4, 4), None),
            ((128, 8, 4), None),
            ((64, 4, 2), None),
            ((64, 2, 4), None),
            ((256, 8, 4), None),
        ]
        configs += [(None, split) for split in (1, 2, 4, 8) if split != shipped.split_k]
        for tiles, split_k in configs:
            gemv = qm._gemv_config if tiles is None else (lambda *args, tiles=tiles: tiles)
            choose = qm.choose_split_k if split_k is None else (lambda *args, s=split_k: s)
            with forced(qm, "_gemv_config", gemv), forced(qm, "choose_split_k", choose):
                plan = qm.plan_quant_matmul(1, n, k, 2, 4, 128, x.device)

                call = functools.partial(qm.w4a16_matmul, x, packed, scales)
                out = call()
                impl = f"BLOCK_N {plan.block_n}, warps {plan.num_warps}, "
                impl += f"stages {plan.num_stages}, split-K {plan.split_k}"
                m = bench.run("w4a16 sweep", f"M=1 N={n} K={k}", impl, call, nbytes, flops)
            rows.append(
                {
                    "shape": [1, n, k],
                    "plan": asdict(plan),
                    "shipped": tiles is None and split_k is None,
                    "time_ms": m.time_ms,
                    "pct_of_bandwidth": m.pct_of_bandwidth,
                    "max_abs_err": max_abs_error(out, expected),
                }
            )
    return rows


SWEEPS = {"prefill": sweep_prefill, "decode": sweep_decode, "w4a16_gemv": sweep_w4a16_gemv}


def run(
    quick: bool,
    only: list[str] | None = None,
    graphs: bool = True,
    sweeps: bool = False,
    checkpoint: Callable[[dict], None] | None = None,
) -> dict:
    """Run the benchmarks (all kernels, or those named in `only`) on this CUDA GPU, then the
    CUDA-graph decode steps when `graphs`, then the configuration sweeps when `sweeps`;
    return the results (what main writes). `checkpoint` is called with the results so far
    after each part, so that a run cut short still leaves them; a part that raises is
    recorded under "errors" and the others still run."""
    unknown = set(only or ()) - set(KERNEL_BENCHMARKS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; known: {list(KERNEL_BENCHMARKS)}")
    global DTYPE
    if not torch.cuda.is_bf16_supported():
        DTYPE = torch.float16
    name = torch.cuda.get_device_name()
    spec = spec_for_cuda_name(name)
    if spec is None:
        from minillm.lab.measure import this_machine

        print(f"{name} is not in the spec table; measuring its peaks instead", flush=True)
        spec = this_machine("cuda")
    print(f"{name}: roofline of {spec.name}", flush=True)
    torch.manual_seed(0)
    bench = Bench(spec)
    results = {
        "device": name,
        "spec": spec.name,
        "spec_measured": spec.measured,
        "dtype": str(DTYPE).removeprefix("torch."),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "quick": quick,
        "complete": False,
        "measurements": [],
        "decode_step_cuda_graphs": [],
        "sweeps": {},
        "errors": {},
        "goals": {},
    }

    def part(label: str, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except Exception as exc:  # one broken part must not cost the others' numbers
            print(f"{label} failed: {type(exc).__name__}: {exc}", flush=True)
            results["errors"][label] = f"{type(exc).__name__}: {exc}"[:2000]
            return None
        finally:
            results["measurements"] = [asdict(m) for m in bench.measurements]
            results["goals"] = evaluate_goals(bench.measurements)
            if checkpoint is not None:
                checkpoint(results)

    for kernel, bench_fn in KERNEL_BENCHMARKS.items():
        if only is None or kernel in only:
            part(kernel, functools.partial(bench_fn, bench, quick))
    if graphs:
        results["decode_step_cuda_graphs"] = (
            part("cuda_graphs", lambda: bench_decode_step_graphs(quick)) or []
        )
    if sweeps:
        sweep_bench = Bench(spec)  # its measurements stay out of the goals and the tables
        for label, sweep_fn in SWEEPS.items():
            results["sweeps"][label] = part(
                f"sweep {label}", functools.partial(sweep_fn, sweep_bench)
            )
    results["complete"] = True
    if checkpoint is not None:
        checkpoint(results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        default="benchmarks/results",
        help="folder for the JSON results file (default: benchmarks/results)",
    )
    parser.add_argument("--quick", action="store_true", help="one case per kernel")
    parser.add_argument(
        "--only",
        nargs="*",
        choices=list(KERNEL_BENCHMARKS),
        help="only these kernels (none, with --sweeps: the sweeps alone)",
    )
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph steps")
    parser.add_argument(
        "--sweeps", action="store_true", help="also time other tile and pipeline configurations"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "minillm.lab.kernel_bench needs a CUDA GPU (torch.cuda.is_available() is False); "
            "the kernels' correctness tests run without one: pytest tests/kernels",
            file=sys.stderr,
        )
        return 2
    import kernels

    if kernels.INTERPRETED:
        print("unset TRITON_INTERPRET: the interpreter's timings mean nothing", file=sys.stderr)
        return 2

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernels_{device_slug(torch.cuda.get_device_name())}.json"

    def write(results: dict) -> None:  # after every part: a run cut short keeps its numbers
        partial = path.with_suffix(".json.tmp")
        partial.write_text(json.dumps(results, indent=2) + "\n")
        partial.replace(path)

    results = run(
        args.quick, args.only, graphs=not args.no_graphs, sweeps=args.sweeps, checkpoint=write
    )
    print(json.dumps(results["goals"], indent=2))
    print(f"wrote {path}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
