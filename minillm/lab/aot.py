"""Compile kernels ahead of time for a GPU architecture, on a machine without a GPU, and
read what the compiler made of them.

Triton lowers a kernel to a cubin for any target it supports without a device present.
This module compiles each kernel as the JIT would compile it at its first launch on that
GPU: with the block sizes, pipeline depth and split counts its launcher picks for the
architecture (`kernels.device.assume_gpu`), and with the JIT's own specializations of the
arguments, derived by the JIT's binder from representative run-time values. That last
part matters: at a launch, pointers aligned to 16 bytes and integers divisible by 16
are marked so (`tt.divisibility`), and integers equal to 1 become constants; without
those marks the compiler can prove no load contiguous and aligned, so it vectorizes and
pipelines nothing, and reports a kernel that never runs.

For each compiled kernel it prints one JSON line: the configuration, the shared memory
Triton allocates, the registers per thread and the bytes spilled to local memory (from the
cubin, through the `cuobjdump` that ships with Triton), the asynchronous copies into
shared memory (`cp.async`: software pipelining) with their sizes, the widths of the other
global loads, which tensor-core instruction the dots became (`wgmma` on Hopper, `mma.sync`
before it), and the occupancy those resources allow. Run it with TRITON_INTERPRET=0 (the
kernels must be defined compiled, not interpreted):

    TRITON_INTERPRET=0 python -m minillm.lab.aot 90 [--kernels flash_attention ...]
        [--dtypes bf16 fp16 fp32] [--head-dims 128 64 80 256]

The architecture is any compute capability of `kernels.device.ARCH_LIMITS` (75, 80, 86,
89, 90). The run-time values are those of Llama 3.1 8B (32 query heads on 8 KV heads of
128, hidden size 4096, MLP 14336) on a GPU of `SM_COUNT` SMs, as in the kernel benchmark.
tests/kernels/test_gpu_compile.py runs it for sm_90, sm_89 and sm_75 (Colab's T4, in
float16: it has no bfloat16); chapter 5 shows what it reports for the attention kernels on
an H100.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import MockTensor, create_function_from_signature

import kernels
import kernels.device
from kernels import (
    flash_attention,
    int8_gemm,
    kv_cache,
    paged_decode,
    quant_matmul,
    rmsnorm,
    rope,
)

ARCHS = sorted(major * 10 + minor for major, minor in kernels.device.ARCH_LIMITS)
SM_COUNT = {75: 40, 80: 108, 86: 84, 89: 58, 90: 132}  # T4, A100, A10, L4, H100/H200
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Llama 3.1 8B, as in minillm.lab.kernel_bench
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, MLP = 32, 8, 128, 4096, 14336


def cuobjdump(cubin: bytes, flag: str) -> str:
    """What Triton's bundled `cuobjdump FLAG` prints for a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, flag, f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """How many times each SASS opcode (I2F, LOP3, HFMA2 ..., without modifiers) occurs in
    a cubin, as `cuobjdump -sass` disassembles it."""
    sass = cuobjdump(cubin, "-sass")
    found = re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return collections.Counter(m.group(1) for m in found)


CACHE_BLOCK_SIZE, NUM_CACHE_BLOCKS, MAX_BLOCKS_PER_SEQ = 16, 8192, 512


@dataclass(slots=True)
class Case:
    """One kernel launch as its launcher would make it: the @triton.jit function, every
    argument by name (tensors as `MockTensor`s of their dtype, ints and floats with
    representative run-time values, constexprs), and the launch options."""

    name: str
    fn: object
    args: dict
    num_warps: int
    num_stages: int


def specialize(case: Case, arch: int) -> tuple[ASTSource, GPUTarget, dict]:
    """What the JIT would compile for `case` at its first launch on sm_<arch>: its binder
    turns the argument values into the signature, the constants and the specialization
    attributes (`tt.divisibility` 16 for aligned pointers and multiples of 16, constants for
    1s), exactly as `JITFunction.run` does before it compiles."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(case.fn.signature, case.fn.params, backend)
    launch = {"num_warps": case.num_warps, "num_stages": case.num_stages}
    bound, specialization, options = binder(**case.args, **launch)
    options, signature, constexprs, attrs = case.fn._pack_args(
        backend, launch, bound, specialization, options
    )
    return ASTSource(case.fn, signature, constexprs, attrs), target, options.__dict__


def compile_like_jit(case: Case, arch: int):
    """Compile `case` for sm_<arch> as the JIT would at its first launch there."""
    source, target, options = specialize(case, arch)
    return triton.compile(source, target=target, options=options)


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local-memory bytes per thread: spills and stack) of the one
    kernel in a cubin, as `cuobjdump --dump-resource-usage` reports them."""
    report = cuobjdump(cubin, "--dump-resource-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's report: {report[-500:]}")
    registers, stack, local = map(int, found.groups())
    return registers, max(stack, local)


_CP_ASYNC = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.\S+)? \[[^\]]*\], \[[^\]]*\], (\w+)")
_LD_GLOBAL = re.compile(r"\bld\.global((?:\.[\w:]+)*)\s")


def ptx_memory_ops(ptx: str) -> dict:
    """What the PTX moves and how: cp.async copies by size in bytes, the other global loads
    by width in bytes per thread (a 16-byte load is 'ld.global.v4.b32'), and the kind of
    tensor-core instruction."""
    copies = collections.Counter(int(size, 0) for size in _CP_ASYNC.findall(ptx))
    loads: collections.Counter = collections.Counter()
    for suffix in _LD_GLOBAL.findall(ptx):
        parts = suffix.split(".")
        vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next(int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p))
        loads[vector * bits // 8] += 1
    tensor_cores = (
        "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    )
    return {
        "cp_async": sum(copies.values()),
        "cp_async_bytes": dict(sorted(copies.items())),
        "global_load_bytes": dict(sorted(loads.items())),
        "tensor_cores": tensor_cores,
    }


def inspect(case: Case, arch: int) -> dict:
    """Compile `case` for sm_<arch> and report what the compiler made of it."""
    compiled = compile_like_jit(case, arch)
    registers, spill_bytes = cubin_resources(compiled.asm["cubin"])
    cc = divmod(arch, 10)
    limit = kernels.device.ARCH_LIMITS[cc].shared_memory_per_program
    shared = compiled.metadata.shared
    row = {"shared_bytes": shared, "limit": limit, "registers": registers}
    row |= {"spill_bytes": spill_bytes, **ptx_memory_ops(compiled.asm["ptx"])}
    row["sass_i2f"] = sass_opcodes(compiled.asm["cubin"])["I2F"]  # int-to-float conversions
    if shared <= limit:
        occ = kernels.device.occupancy(cc, case.num_warps, shared, registers)
        row |= {"programs_per_sm": occ.programs_per_sm, "occupancy_limiter": occ.limiter}
    return row


def tensors(**dtypes: torch.dtype) -> dict:
    return {name: MockTensor(dtype) for name, dtype in dtypes.items()}


def cases(dtype: torch.dtype, head_dims: list[int]) -> Iterator[Case]:
    """Every kernel, configured by its launcher for the assumed GPU (`assume_gpu`)."""
    gpu = torch.device("cuda", 0)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    dot_fp32 = dtype == torch.float32
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    cache_value_offset = NUM_CACHE_BLOCKS * CACHE_BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
    yield Case(
        "rms_norm",
        rmsnorm._rms_norm_kernel,
        tensors(x_ptr=dtype, residual_ptr=dtype, weight_ptr=dtype, out_ptr=dtype)
        | tensors(residual_out_ptr=dtype)
        | dict(hidden_size=HIDDEN, eps=1e-5, HAS_RESIDUAL=True, BLOCK=HIDDEN),
        rmsnorm.num_warps_for(HIDDEN),
        1,
    )
    yield Case(
        "rope",
        rope._rope_kernel,
        tensors(q_ptr=dtype, k_ptr=dtype, q_out_ptr=dtype, k_out_ptr=dtype, positions_ptr=i64)
        | tensors(cos_sin_ptr=f32)
        | dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, HALF=HEAD_DIM // 2)
        | dict(BLOCK_H=NUM_HEADS, BLOCK_HALF=HEAD_DIM // 2),
        4,
        1,
    )
    row = NUM_KV_HEADS * HEAD_DIM
    yield Case(
        "reshape_and_cache",
        kv_cache._reshape_and_cache_kernel,
        tensors(k_ptr=dtype, v_ptr=dtype, kv_cache_ptr=dtype, slot_mapping_ptr=i64)
        | dict(cache_value_offset=cache_value_offset, ROW=row, BLOCK=row),
        4,
        1,
    )
    for head_dim in head_dims:
        block_m, block_n, warps, stages = flash_attention._launch_config(head_dim, itemsize, gpu)
        offset = NUM_CACHE_BLOCKS * CACHE_BLOCK_SIZE * NUM_KV_HEADS * head_dim
        yield Case(
            "flash_attention" + ("" if head_dim == HEAD_DIM else f" d={head_dim}"),
            flash_attention._flash_attention_kernel,
            tensors(q_ptr=dtype, k_ptr=dtype, v_ptr=dtype, out_ptr=dtype, cu_seqlens_ptr=i32)
            | tensors(kv_cache_ptr=dtype, block_tables_ptr=i32, prefix_lens_ptr=i32)
            | dict(scale_log2e=head_dim**-0.5 * 1.4426950408889634)
            | dict(block_tables_stride=MAX_BLOCKS_PER_SEQ, cache_value_offset=offset)
            | dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, HEAD_DIM=head_dim)
            | dict(CACHE_BLOCK_SIZE=CACHE_BLOCK_SIZE, HAS_PREFIX=True, DOT_FP32=dot_fp32)
            | dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim)),
            warps,
            stages,
        )
    for group, num_splits in ((NUM_HEADS // NUM_KV_HEADS, 4), (64, 1)):
        block_g = max(16, triton.next_power_of_2(group))
        block_n, warps, stages = paged_decode._launch_config(block_g, HEAD_DIM, itemsize, gpu)
        yield Case(
            "paged_decode_split" + ("" if group == 4 else f" group={group}"),
            paged_decode._paged_decode_split_kernel,
            tensors(q_ptr=dtype, kv_cache_ptr=dtype, block_tables_ptr=i32, seq_lens_ptr=i32)
            | tensors(partial_out_ptr=f32, partial_lse_ptr=f32, out_ptr=dtype)
            | dict(scale_log2e=HEAD_DIM**-0.5 * 1.4426950408889634)
            | dict(block_tables_stride=MAX_BLOCKS_PER_SEQ, cache_value_offset=cache_value_offset)
            | dict(num_heads=group, num_kv_heads=1, num_splits=num_splits, HEAD_DIM=HEAD_DIM)
            | dict(CACHE_BLOCK_SIZE=CACHE_BLOCK_SIZE, SINGLE_SPLIT=num_splits == 1)
            | dict(DOT_FP32=dot_fp32, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=HEAD_DIM),
            warps,
            stages,
        )
    yield Case(
        "merge_splits",
        paged_decode._merge_splits_kernel,
        tensors(partial_out_ptr=f32, partial_lse_ptr=f32, out_ptr=dtype)
        | dict(num_splits=4, HEAD_DIM=HEAD_DIM, BLOCK_S=4, BLOCK_D=HEAD_DIM),
        4,
        1,
    )
    # the quantized matmuls at a decode step (batch 1 and 16) and at a 4k-token prefill
    for weight_bits, m in ((8, 1), (8, 4096), (4, 1), (4, 16), (4, 4096)):
        group_size = quant_matmul.DEFAULT_GROUP_SIZE if weight_bits == 4 else None
        plan = quant_matmul.plan_quant_matmul(
            m, MLP, HIDDEN, itemsize, weight_bits, group_size, gpu
        )
        args = tensors(x_ptr=dtype, scales_ptr=dtype)
        args |= {"out_ptr": MockTensor(dtype if plan.split_k == 1 else f32)}
        args |= dict(M=m, N=MLP, K=HIDDEN, SPLIT_K=plan.split_k)
        args |= dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n)
        if plan.kernel == "w8a16":
            fn = quant_matmul._w8a16_kernel
            args |= tensors(w_ptr=torch.int8) | dict(DOT_FP32=dot_fp32, BLOCK_K=plan.block_k)
        else:
            # with zero points (AWQ and GPTQ checkpoints): the launch that loads the most
            args |= tensors(packed_ptr=torch.uint8, zeros_ptr=torch.uint8)
            args |= dict(GROUP_SIZE=group_size)
            if plan.kernel == "w4a16_gemv":
                fn = quant_matmul._w4a16_gemv_kernel
                args |= dict(NUM_STAGES=plan.num_stages)
            else:
                fn = quant_matmul._w4a16_kernel
                args |= dict(DOT_FP32=dot_fp32)
        yield Case(f"{plan.kernel} M={m}", fn, args, plan.num_warps, plan.num_stages)
    # W8A8: int8 x int8 -> int32 on the tensor cores, at a decode step and a 4k prefill
    # (from Ampere on: Triton has no int8 dot for Turing)
    for m in (1, 4096) if int8_gemm.supported(gpu) else ():
        block_m, block_n, block_k, warps, stages = int8_gemm.launch_config(m)
        yield Case(
            f"w8a8 M={m}",
            int8_gemm._w8a8_kernel,
            tensors(qx_ptr=torch.int8, qw_ptr=torch.int8, x_scales_ptr=f32, w_scales_ptr=f32)
            | tensors(out_ptr=dtype)
            | dict(M=m, N=MLP, K=HIDDEN, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k),
            warps,
            stages,
        )
    yield Case(
        "sum_splits",
        quant_matmul._sum_splits_kernel,
        tensors(partial_ptr=f32, out_ptr=dtype)
        | dict(numel=MLP, SPLIT_K=3, BLOCK=quant_matmul.SUM_BLOCK),
        4,
        1,
    )


def case_config(case: Case) -> dict:
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_G", "SPLIT_K")
    config = {"num_warps": case.num_warps, "num_stages": case.num_stages}
    return config | {key: case.args[key] for key in keys if key in case.args}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", type=int, choices=ARCHS)
    parser.add_argument("--kernels", nargs="+", help="only these case names (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp32"])
    parser.add_argument(
        "--head-dims", nargs="+", type=int, default=[HEAD_DIM], help="FlashAttention's"
    )
    args = parser.parse_args(argv)
    if kernels.INTERPRETED:
        print("run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    arch = args.arch
    with kernels.device.assume_gpu(divmod(arch, 10), SM_COUNT[arch]):
        for dtype_name in args.dtypes:
            for case in cases(DTYPES[dtype_name], args.head_dims):
                if args.kernels and case.name not in args.kernels:
                    continue
                row = {"arch": arch, "dtype": dtype_name, "kernel": case.name}
                row |= case_config(case)
                try:
                    row |= {"ok": True, **inspect(case, arch)}
                except Exception as exc:  # report every failure, not just the first
                    row |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
