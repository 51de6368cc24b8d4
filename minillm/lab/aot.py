"""Compile kernels ahead of time for a GPU architecture, on a machine without a GPU.

Triton can lower a kernel to a cubin for any target it supports without a device present.
This module does so for each kernel with the block sizes and pipeline depth its launcher
picks for that architecture's shared memory per program, and prints one JSON line per
kernel: whether it compiled and the shared memory the compiled kernel uses (what Triton
really allocates, which may be less than the launcher's budget: a tile the compiler keeps
in registers takes no shared memory). Registers are known only once the cubin is loaded on
a GPU. Run it with TRITON_INTERPRET=0 (the kernels must be defined compiled, not
interpreted), optionally naming kernels and dtypes:

    TRITON_INTERPRET=0 python -m minillm.lab.aot 90 [--kernels flash_attention ...]
        [--dtypes bf16 fp16 fp32]

The architecture is any compute capability of `kernels.device.ARCH_LIMITS` (75, 80, 86,
89, 90). tests/kernels/test_gpu_compile.py runs it for sm_90, sm_89 and sm_75 (Colab's
T4, in float16: it has no bfloat16); chapter 5 shows what it reports for FlashAttention on
an H100.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels
import kernels.device
from kernels import flash_attention, kv_cache, paged_decode, quant_matmul, rmsnorm, rope

# opt-in shared memory per program (CUDA's cudaDevAttrMaxSharedMemoryPerBlockOptin)
SHARED_MEMORY_BYTES = {
    major * 10 + minor: kernels.device.ARCH_LIMITS[(major, minor)].shared_memory_per_program
    for major, minor in kernels.device.ARCH_LIMITS
}
HEAD_DIM, GROUP = 128, 4


def compile_kernel(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int, arch: int):
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options
    )
    return compiled.metadata.shared


def cases(dtype: str, itemsize: int):
    """(name, kernel, argument types, constexprs, num_warps, num_stages) per kernel."""
    cuda = torch.device("cuda", 0)
    p = f"*{dtype}"
    dot_fp32 = dtype == "fp32"
    yield (
        "rms_norm",
        rmsnorm._rms_norm_kernel,
        dict(x_ptr=p, residual_ptr=p, weight_ptr=p, out_ptr=p, residual_out_ptr=p),
        dict(HAS_RESIDUAL=True, BLOCK=8192),
        16,
        1,
    )
    yield (
        "rope",
        rope._rope_kernel,
        dict(q_ptr=p, k_ptr=p, q_out_ptr=p, k_out_ptr=p, positions_ptr="*i64"),
        dict(HALF=HEAD_DIM // 2, BLOCK_H=32, BLOCK_HALF=HEAD_DIM // 2),
        4,
        1,
    )
    yield (
        "reshape_and_cache",
        kv_cache._reshape_and_cache_kernel,
        dict(k_ptr=p, v_ptr=p, kv_cache_ptr=p, slot_mapping_ptr="*i64"),
        dict(ROW=8 * HEAD_DIM, BLOCK=8 * HEAD_DIM),
        4,
        1,
    )
    block_m, block_n, warps, stages = flash_attention._launch_config(HEAD_DIM, itemsize, cuda)
    yield (
        "flash_attention",
        flash_attention._flash_attention_kernel,
        dict(q_ptr=p, k_ptr=p, v_ptr=p, out_ptr=p, kv_cache_ptr=p),
        dict(
            HEAD_DIM=HEAD_DIM,
            CACHE_BLOCK_SIZE=16,
            HAS_PREFIX=True,
            DOT_FP32=dot_fp32,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=HEAD_DIM,
        ),
        warps,
        stages,
    )
    block_n, warps, stages = paged_decode._launch_config(16, HEAD_DIM, itemsize, cuda)
    yield (
        "paged_decode_split",
        paged_decode._paged_decode_split_kernel,
        dict(q_ptr=p, kv_cache_ptr=p, partial_out_ptr="*fp32", partial_lse_ptr="*fp32"),
        dict(
            HEAD_DIM=HEAD_DIM,
            CACHE_BLOCK_SIZE=16,
            DOT_FP32=dot_fp32,
            BLOCK_G=16,
            BLOCK_N=block_n,
            BLOCK_D=HEAD_DIM,
        ),
        warps,
        stages,
    )
    yield (
        "merge_splits",
        paged_decode._merge_splits_kernel,
        dict(partial_out_ptr="*fp32", partial_lse_ptr="*fp32", out_ptr=p),
        dict(HEAD_DIM=HEAD_DIM, BLOCK_S=64, BLOCK_D=HEAD_DIM),
        4,
        1,
    )
    for m, split_k in ((1, 4), (4096, 1)):
        block_m, block_n, warps, stages = quant_matmul._launch_config(m, 128, itemsize, 8, cuda)
        yield (
            f"w8a16 M={m}",
            quant_matmul._w8a16_kernel,
            dict(x_ptr=p, w_ptr="*i8", scales_ptr=p, out_ptr=p),
            dict(SPLIT_K=split_k, DOT_FP32=dot_fp32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128),
            warps,
            stages,
        )
        block_m, block_n, warps, stages = quant_matmul._launch_config(m, 128, itemsize, 4, cuda)
        yield (
            f"w4a16 M={m}",
            quant_matmul._w4a16_kernel,
            dict(x_ptr=p, packed_ptr="*u8", scales_ptr=p, out_ptr=p),
            dict(
                SPLIT_K=split_k,
                DOT_FP32=dot_fp32,
                GROUP_SIZE=128,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
            ),
            warps,
            stages,
        )


# the scalar arguments, by name, across all kernels
SCALAR_TYPES = {
    "eps": "fp32",
    "scale_log2e": "fp32",
    "cache_value_offset": "i64",
    **{name: "i32" for name in ("hidden_size", "num_heads", "num_kv_heads", "num_splits")},
    **{name: "i32" for name in ("block_tables_stride", "M", "N", "K")},
    **{name: "*i32" for name in ("cu_seqlens_ptr", "block_tables_ptr", "prefix_lens_ptr")},
    **{name: "*i32" for name in ("seq_lens_ptr",)},
    "cos_sin_ptr": "*fp32",
}


ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", type=int, choices=sorted(SHARED_MEMORY_BYTES))
    parser.add_argument("--kernels", nargs="+", help="only these (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=list(ITEMSIZE), default=["bf16", "fp32"])
    args = parser.parse_args(argv)
    if kernels.INTERPRETED:
        print("run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    arch = args.arch
    # the launchers size their tiles from this architecture's shared memory
    kernels.device.max_shared_memory_bytes = lambda device: SHARED_MEMORY_BYTES[arch]
    for dtype in args.dtypes:
        for name, fn, types, constexprs, num_warps, num_stages in cases(dtype, ITEMSIZE[dtype]):
            if args.kernels and name not in args.kernels:
                continue
            row = {"arch": arch, "dtype": dtype, "kernel": name, "num_stages": num_stages}
            row |= {"num_warps": num_warps}
            row |= {k: v for k, v in constexprs.items() if k in ("BLOCK_M", "BLOCK_N")}
            try:
                shared = compile_kernel(
                    fn, {**SCALAR_TYPES, **types}, constexprs, num_warps, num_stages, arch
                )
                row |= {"ok": True, "shared_bytes": shared, "limit": SHARED_MEMORY_BYTES[arch]}
            except Exception as exc:  # report every failure, not just the first
                row |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
