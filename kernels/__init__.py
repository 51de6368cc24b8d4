"""Triton kernels, each with a PyTorch reference oracle beside it.

One module per kernel: the `@triton.jit` kernel, its launcher (which checks shapes, dtypes,
devices and strides, raising ValueError before anything is launched, and then picks block
sizes), a PyTorch reference that shares no code with the kernel, and the bytes moved and
FLOPs done per call, from which the benchmarks draw the roofline.

- `kernels.rmsnorm`: RMSNorm, optionally fused with the residual add before it.
- `kernels.rope`: rotary position embedding of q and k at per-token positions.
- `kernels.flash_attention`: FlashAttention forward for prefill (causal, GQA, packed
  variable-length sequences) that also attends over a prefix held in the paged KV cache.
- `kernels.paged_decode`: one query per sequence over its block table, split-KV
  (Flash-Decoding) with a log-sum-exp merge.
- `kernels.quant_matmul`: weight-only quantized matmul, W8A16 per output channel and W4A16
  group-wise, dequantized inside the GEMM.
- `kernels.int8_gemm`: W8A8, int8 activations (per token) times int8 weights (per channel),
  summed in int32, the scales applied in the epilogue.
- `kernels.kv_cache`: the store of new keys and values into their cache slots.
- `minillm.model.triton_backend`: the engine's "triton" attention backend built from them.
- `kernels.checks`, `kernels.device`: the launchers' input checks, and the device facts
  (SM count, shared memory) their block sizes depend on.
- `minillm.lab.aot`: every kernel compiled ahead of time for a GPU architecture, without a GPU,
  the way the JIT compiles it there, and what the compiler made of it.
- `minillm.lab.kernel_bench`: every kernel timed beside its PyTorch baseline on a GPU's roofline.

Tests: tests/kernels/ compares each kernel with its reference on hypothesis-drawn shapes,
under the interpreter on a CPU and compiled on a GPU; tests/kernels/test_gpu_compile.py
compiles every kernel for sm_90, sm_89 and sm_75 without a GPU, as the JIT would, and reads
the result (shared memory, registers, spills, cp.async pipelining, tensor-core
instructions). Benchmarks: `python -m minillm.lab.kernel_bench` on a GPU;
scripts/gpu_check.sh runs every GPU check at once, within a time budget.

Running without a GPU. Triton decides when `@triton.jit` runs, that is when a kernel module
is imported, whether the kernel is compiled for a GPU or run by its interpreter, a NumPy
emulation of the same program that is slow but exact enough to test against. So this file,
which runs before any kernel module, sets TRITON_INTERPRET=1 when CUDA is unavailable and
the user has not set the variable either way. Setting it after a kernel module is imported
does nothing: launches then fail with "0 active drivers". `INTERPRETED` records the choice.
The variable must also be set before `triton` itself is imported, since Triton's own
library functions (`tl.sum`, `tl.max`, ...) are made interpretable or not as it loads.
PyTorch imports triton on its own when something loads `torch._dynamo` (even constructing a
module under a `torch.device` context can), which is why `minillm.model.llama` imports this
package first. When triton was already loaded without the interpreter, `LATE_INTERPRETER`
is True and every launcher says so (see `kernels.checks.check_device`) instead of failing
deep inside Triton.

Two interpreter facts shape the kernels: bfloat16 `tl.dot` gives wrong numbers there, and
float32 `tl.dot` is exact there (a GPU uses TF32 unless told otherwise). Every kernel
therefore computes its dots in float32 when interpreted, and asks for IEEE float32 when its
inputs are float32 on a GPU.
"""

from __future__ import annotations

import os
import sys

import torch

LATE_INTERPRETER = False
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    LATE_INTERPRETER = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
