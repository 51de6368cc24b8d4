"""Weight-only quantized matmul: W8A16 per output channel, W4A16 group-wise.

Math. A linear layer computes y = x W^T with x: [M, K] activations and W: [N, K] weights.
Weight-only quantization stores W as small integers q and float scales s, and keeps x in
16 bits ("W8A16", "W4A16"):

- W8A16, per output channel: s_n = max_k |W[n, k]| / 127, q = round(W / s_n) in [-127, 127]
  (int8). y[m, n] = s_n * sum_k x[m, k] q[n, k]: the scale factors out of the sum, so it is
  applied once, after the K loop.
- W4A16, group-wise (group_size = 128 by default, as in GPTQ and AWQ): every run of
  group_size weights along K in a row has its own scale s_{n,g} and a 4-bit code u in
  [0, 15] per weight; two codes share a byte (`pack_int4`). W = s (u - z) with a zero point
  z per group: z = 8 for the symmetric grid `quantize_w4` makes (s = max |W| / 7, u - 8 =
  round(W / s) in [-8, 7]), any z in [0, 15] from an asymmetric one (AWQ, GPTQ), stored
  [K / group_size, N] uint8. y[m, n] = sum_g s_{n,g} sum_{k in g} x[m, k] (u[n, k] - z_{n,g}):
  each K tile is one group, so its partial dot is scaled as it is added, and the zero point
  costs nothing beyond its load: it is subtracted while the codes are dequantized.

Dequantization happens inside the GEMM, so the weight bytes that cross the memory bus are
the quantized ones, 1 or 1/2 byte per weight. int8 codes are converted to x's dtype (exact:
|q| <= 127). 4-bit codes go by the magic-number trick (as in FasterTransformer and Marlin)
instead of an int-to-float conversion per weight, a slow instruction on a GPU: 1024.0 in
float16 is 0x6400, and its 10 mantissa bits are zero with a unit in the last place of 1,
so OR-ing u into them gives the bits of 1024 + u. Subtracting 1024 + z (built from z the
same way) leaves u - z, exactly: one OR and one subtraction per weight. float32 uses
2^23 = 0x4B000000: bfloat16 activations get their weights that way and one conversion
(Triton computes bfloat16 arithmetic in float32 before Hopper), as does the GEMV below.

At batch 1 a matmul reads every weight once and does 2 FLOPs per weight: it is bound by
memory bandwidth, and moving 4x fewer bytes than bfloat16 is the whole point of W4A16, if
the unpacking keeps up.

Tiling: one program per [BLOCK_M, BLOCK_N] output tile walks K in BLOCK_K steps (W4:
BLOCK_K = group_size), accumulating in float32. At decode-sized M there are too few output
tiles to keep every SM streaming weights, so K is split among SPLIT_K programs per tile
(split-K); one small kernel then adds their float32 partial sums in a fixed order and
rounds once to x's dtype. Under the interpreter the dots are float32.

W4A16's loads are laid out for the memory system. A program reads, per group, x's
[BLOCK_M, group_size] tile and the packed weights' [BLOCK_N, group_size / 2] tile, both
contiguous along K, so the compiler issues 16-byte loads and pipelines them through shared
memory (cp.async); the nibbles are put back in k order in registers (`tl.interleave`), and
one dot per group follows. Scales are stored [K / group_size, N], so a group's scales for
BLOCK_N columns are one contiguous read. At M <= GEMV_MAX_M rows a tensor-core tile would
be mostly padding: a GEMV kernel multiplies each unpacked weight tile with the few rows of
x on the CUDA cores instead, in float32 (its codes dequantized by the float32 magic number,
so there is nothing to widen), and sums along K.

Cost per call: FLOPs quant_matmul_flops() = 2 M N K; bytes moved quant_matmul_bytes():
x read and y written, (M K + M N) * itemsize, plus the quantized weights (N K or N K / 2
bytes) and their scales, each read once (zero points, 1 byte per group and column when
there are any, are not counted; split-K's partial sums, 4 SPLIT_K M N bytes
written and read, are not counted: they are not part of the problem).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import INTERPRETED
from kernels.checks import (
    check_contiguous,
    check_device,
    check_dtype,
    check_same_device,
    check_shape,
)
from kernels.device import fit_num_stages, sm_count, tensor_core_dots

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_GROUP_SIZE = 128
W8_MAX, W4_MIN, W4_MAX = 127, -8, 7
MAX_SPLIT_K = 16
# a split-K share shorter than this costs more in partial sums than it gains (interpreter:
# 1, so that small test shapes split too)
MIN_K_STEPS_PER_SPLIT = 1 if INTERPRETED else 4
W8_BLOCK_K = 64 if INTERPRETED else 128
# W4A16 at M <= GEMV_MAX_M rows runs the GEMV kernel (no tensor cores, no padding to 16 rows)
GEMV_MAX_M = 4
SUM_BLOCK = 1024  # elements per program of the split-K sum


# --- quantization and packing (plain PyTorch, run once per weight) ---


def quantize_w8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [N, K] float -> (qweight [N, K] int8, scales [N] in weight's dtype)."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / W8_MAX).to(weight.dtype)
    divisor = torch.where(scales == 0, 1.0, scales.float())  # an all-zero row stays zero
    qweight = (w / divisor[:, None]).round().clamp(-W8_MAX, W8_MAX).to(torch.int8)
    return qweight, scales


def quantize_w4(
    weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [N, K] float, K a multiple of group_size -> (packed [N, K / 2] uint8,
    scales [K / group_size, N] in weight's dtype). The scales are stored group-major, as
    GPTQ and AWQ checkpoints store them, so that one group's scales for a run of output
    columns are contiguous in memory."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"weight's K ({k}) must be a multiple of group_size ({group_size})")
    groups = weight.float().view(n, k // group_size, group_size)
    scales = (groups.abs().amax(dim=2) / W4_MAX).to(weight.dtype)
    divisor = torch.where(scales == 0, 1.0, scales.float())
    q = (groups / divisor[..., None]).round().clamp(W4_MIN, W4_MAX).to(torch.int8)
    return pack_int4(q.view(n, k)), scales.T.contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] int8 in [-8, 7], K even -> [N, K / 2] uint8: byte i holds q[:, 2i] + 8 in its
    low nibble and q[:, 2i + 1] + 8 in its high nibble."""
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q must be int8 of shape [N, even K], got {q.dtype} {list(q.shape)}")
    if q.numel() and not (W4_MIN <= int(q.min()) and int(q.max()) <= W4_MAX):
        raise ValueError(f"int4 values must lie in [{W4_MIN}, {W4_MAX}]")
    biased = (q.to(torch.int16) - W4_MIN).to(torch.uint8)  # 0 .. 15
    return biased[:, 0::2] | (biased[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [N, K / 2] uint8 -> [N, K] int8."""
    low = (packed & 0xF).to(torch.int8) + W4_MIN
    high = (packed >> 4).to(torch.int8) + W4_MIN
    return torch.stack((low, high), dim=-1).flatten(1)


def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K] int8, [N] -> [N, K] float32."""
    return qweight.float() * scales.float()[:, None]


def dequantize_w4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N, K / 2] uint8, [K / group_size, N] scales and zero points (None: 8, the symmetric
    grid) -> [N, K] float32 s * (u - z), u the stored nibble (u - 8 = `unpack_int4`'s q)."""
    u = unpack_int4(packed).float() - W4_MIN
    z = 8.0 if zeros is None else zeros.float().T.repeat_interleave(group_size, dim=1)
    return (u - z) * scales.float().T.repeat_interleave(group_size, dim=1)


# --- the kernels ---


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask, col_mask = rows < M, cols < N
    # split-K: this program sums one contiguous share of the K steps
    steps_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + steps_per_split * BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(  # [BLOCK_K, BLOCK_N] int8: W^T's tile
            w_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0,
        )
        if DOT_FP32:
            x = x.to(tl.float32)
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")  # int8 -> float: exact
    # per output channel: the scale factors out of the K sum
    scales = tl.load(scales_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = acc * scales[None, :]
    # with SPLIT_K > 1, out is the float32 [SPLIT_K, M, N] buffer of partial sums
    tl.store(
        out_ptr + (split * M + rows).to(tl.int64)[:, None] * N + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _int4_to_float(nibbles, dtype: tl.constexpr):
    """Integers u in [0, 15] -> MAGIC + u in dtype, exactly, with one OR and no int-to-float
    conversion: MAGIC is a power of two whose unit in the last place is 1 (float16 1024 =
    0x6400, float32 2^23 = 0x4B000000), so its low mantissa bits are zero and u written
    into them gives the float MAGIC + u."""
    if dtype == tl.float16:
        return (nibbles.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    else:
        tl.static_assert(dtype == tl.float32, "dtype must be float16 or float32")
        return (nibbles.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_int4_tile(packed, zeros, dtype: tl.constexpr):
    """[R, C] packed bytes and the rows' zero points zeros [R] (in [0, 15]) -> [R, 2C] q - z
    in dtype, exact, in k order: each byte's low nibble (even k), then its high nibble (odd
    k). Both sides carry the same magic number, so (MAGIC + q) - (MAGIC + z) = q - z."""
    zero = _int4_to_float(zeros, dtype)[:, None]
    low = _int4_to_float(packed & 0xF, dtype) - zero
    high = _int4_to_float(packed >> 4, dtype) - zero
    return tl.interleave(low, high)


@triton.jit
def _load_zeros(zeros_ptr, group, N, cols, col_mask, BLOCK_N: tl.constexpr):
    """A group's zero points for BLOCK_N columns ([K / GROUP_SIZE, N] uint8, contiguous per
    group), or the symmetric grid's 8 when there are none (zeros_ptr None)."""
    if zeros_ptr is None:
        return tl.full([BLOCK_N], 8, tl.uint8)
    else:
        return tl.load(zeros_ptr + group * N + cols, mask=col_mask, other=8)


@triton.jit
def _w4a16_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask, col_mask = rows < M, cols < N
    ks = tl.arange(0, GROUP_SIZE)
    pairs = tl.arange(0, GROUP_SIZE // 2)  # a group's bytes
    num_groups = K // GROUP_SIZE
    # split-K: this program sums one contiguous share of the groups
    groups_per_split = tl.cdiv(num_groups, SPLIT_K)
    group_begin = split * groups_per_split
    group_end = tl.minimum(num_groups, group_begin + groups_per_split)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    # a packed row is K / 2 bytes, a multiple of 16 (K is a multiple of GROUP_SIZE >= 32):
    # said here, the compiler loads 16 bytes at a time and pipelines the loads
    w_rows = packed_ptr + cols.to(tl.int64)[:, None] * tl.multiple_of(K // 2, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for group in range(group_begin, group_end):
        # contiguous loads: x's [BLOCK_M, GROUP_SIZE] tile, the weights' [BLOCK_N, GROUP_SIZE / 2]
        x = tl.load(x_rows + group * GROUP_SIZE + ks[None, :], mask=row_mask[:, None], other=0.0)
        packed = tl.load(
            w_rows + group * (GROUP_SIZE // 2) + pairs[None, :], mask=col_mask[:, None], other=0
        )
        if DOT_FP32:
            x = x.to(tl.float32)
        zeros = _load_zeros(zeros_ptr, group, N, cols, col_mask, BLOCK_N)
        # [BLOCK_N, GROUP_SIZE] q - z, back in k order, in the dot's dtype: float16 directly;
        # bfloat16 by way of float32, since before Hopper Triton computes bfloat16 arithmetic
        # in float32 (a bfloat16 subtraction costs conversions, and registers at big tiles)
        if x.dtype == tl.float16:
            w = _dequantize_int4_tile(packed, zeros, tl.float16)
        else:
            w = _dequantize_int4_tile(packed, zeros, tl.float32).to(x.dtype)
        part = tl.dot(x, tl.trans(w), input_precision="ieee")
        # scales are [K / GROUP_SIZE, N]: a group's BLOCK_N scales are contiguous
        scales = tl.load(scales_ptr + group * N + cols, mask=col_mask, other=0.0)
        acc += part * scales.to(tl.float32)[None, :]
    # with SPLIT_K > 1, out is the float32 [SPLIT_K, M, N] buffer of partial sums
    tl.store(
        out_ptr + (split * M + rows).to(tl.int64)[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    SPLIT_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """M <= BLOCK_M <= 4 rows: a matrix-vector product per row, on the CUDA cores. A tensor
    core instruction would pad the rows to 16; here each weight tile, once unpacked, is
    multiplied with every row of x and summed along K."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    col_mask = cols < N
    ks = tl.arange(0, GROUP_SIZE)
    pairs = tl.arange(0, GROUP_SIZE // 2)
    num_groups = K // GROUP_SIZE
    groups_per_split = tl.cdiv(num_groups, SPLIT_K)
    group_begin = split * groups_per_split
    group_end = tl.minimum(num_groups, group_begin + groups_per_split)
    w_rows = packed_ptr + cols.to(tl.int64)[:, None] * tl.multiple_of(K // 2, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # (clamped group indices: always in bounds, no scalar masks)
    scales = tl.load(scales_ptr + tl.minimum(group_begin, num_groups - 1) * N + cols, mask=col_mask)
    # the loop's loads carry no tl.dot, so the pipeline depth is asked for explicitly
    for group in tl.range(group_begin, group_end, num_stages=NUM_STAGES):
        # the next group's scales now: their load overlaps this group's work
        next_group = tl.minimum(group + 1, group_end - 1)
        next_scales = tl.load(scales_ptr + next_group * N + cols, mask=col_mask)
        packed = tl.load(
            w_rows + group * (GROUP_SIZE // 2) + pairs[None, :], mask=col_mask[:, None], other=0
        )
        zeros = _load_zeros(zeros_ptr, group, N, cols, col_mask, BLOCK_N)
        # dequantized straight to float32 (the float32 magic number): the products and sums
        # are float32 here, so 16-bit values would only be widened again
        w = _dequantize_int4_tile(packed, zeros, tl.float32)  # [BLOCK_N, GROUP_SIZE]
        for r in tl.static_range(BLOCK_M):
            # rows past M re-read row M - 1; their sums are never stored
            x = tl.load(x_ptr + tl.minimum(r, M - 1) * K + group * GROUP_SIZE + ks)
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1) * scales.to(tl.float32)
            acc += tl.where(rows[:, None] == r, part[None, :], 0.0)
        scales = next_scales
    tl.store(
        out_ptr + (split * M + rows).to(tl.int64)[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows < M)[:, None] & col_mask[None, :],
    )


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over the SPLIT_K float32 partial results [SPLIT_K, numel], added in split
    order (deterministic) and rounded once to out's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    partial = partial_ptr + offsets
    total = tl.zeros([BLOCK], tl.float32)
    for _ in tl.static_range(SPLIT_K):
        total += tl.load(partial, mask=mask, other=0.0)
        partial += numel
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


def _check_matmul_inputs(
    x: torch.Tensor,
    weight_name: str,
    weight: torch.Tensor,
    weight_dtype: torch.dtype,
    weight_columns: int,
    scales: torch.Tensor,
    scales_rows: int | None,
) -> None:
    """x: [M, K]; weight: [N, weight_columns] of weight_dtype; scales: [N] (scales_rows
    None) or [scales_rows, N] in x's dtype; all contiguous, on x's device."""
    check_dtype(weight_name, weight, (weight_dtype,))
    check_shape(weight_name, weight, (None, weight_columns))
    n = weight.shape[0]
    check_shape("scales", scales, (n,) if scales_rows is None else (scales_rows, n))
    check_dtype("scales", scales, (x.dtype,))
    for name, t in (("x", x), (weight_name, weight), ("scales", scales)):
        check_same_device(name, t, x)
        check_contiguous(name, t)


def _check_activations(x: torch.Tensor) -> None:
    check_dtype("x", x, ACTIVATION_DTYPES)
    check_device("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must have shape [M, K], got {list(x.shape)}")


@dataclass(frozen=True, slots=True)
class MatmulPlan:
    """How one quantized matmul runs: which kernel, its tiles, warps, pipeline depth, and
    how many programs share each output tile's K sum (split_k)."""

    kernel: str  # "w8a16", "w4a16" (tensor cores) or "w4a16_gemv" (M <= GEMV_MAX_M)
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int


def _tile_config(
    m: int, block_k: int, itemsize: int, weight_bits: int, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the tensor-core kernels: thin tiles for
    decode-sized M, where the weights dominate and many programs must stream them; square
    ones for prefill; as many pipeline stages as shared memory holds. Dots on the CUDA cores
    (`tensor_core_dots` false) keep their operands in registers: small tiles, no pipeline."""
    if INTERPRETED:
        return 16, 32, 4, 1
    if not tensor_core_dots(itemsize, device):
        return (16, 32, 4, 1) if m <= 16 else (32, 32, 4, 1)
    if m <= 16:
        candidates = [(16, 32, 4)]
    elif m <= 64:
        candidates = [(64, 64, 4)]
    else:
        candidates = [(128, 128, 8), (64, 128, 4), (64, 64, 4)]
    for block_m, block_n, num_warps in candidates:
        per_stage = block_m * block_k * itemsize + block_k * block_n * weight_bits // 8
        # the weight tile converted to x's dtype is one more tile beside the pipeline
        stages = fit_num_stages(block_k * block_n * itemsize, per_stage, 4, device)
        if stages >= 2:
            return block_m, block_n, num_warps, stages
    return 32, 32, 4, 1


def _gemv_config(group_size: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the W4A16 GEMV: 64 weight rows per program, each
    giving group_size / 2 contiguous bytes per step, pipelined up to 4 groups deep."""
    if INTERPRETED:
        return 32, 4, 1
    block_n = 64
    return block_n, 4, max(1, fit_num_stages(0, block_n * group_size // 2, 4, device))


def choose_split_k(num_tiles: int, num_k_steps: int, num_sms: int) -> int:
    """How many programs share one output tile's K sum. At decode-sized M the output tiles
    alone leave SMs idle and too few bytes in flight: split K until there are about 2
    programs per SM, keeping at least MIN_K_STEPS_PER_SPLIT K steps each (at most
    MAX_SPLIT_K)."""
    wanted = triton.cdiv(2 * num_sms, max(num_tiles, 1))
    most = max(1, num_k_steps // MIN_K_STEPS_PER_SPLIT)
    return max(1, min(wanted, most, MAX_SPLIT_K))


def plan_quant_matmul(
    m: int,
    n: int,
    k: int,
    itemsize: int,
    weight_bits: int,
    group_size: int | None,
    device: torch.device,
) -> MatmulPlan:
    """The plan `w8a16_matmul` (weight_bits 8, group_size None) or `w4a16_matmul`
    (weight_bits 4) follows for x: [m, k] of itemsize bytes and n output columns. Host ints
    only, so that a CUDA graph can replay it."""
    if weight_bits == 4 and m <= GEMV_MAX_M:
        block_n, num_warps, num_stages = _gemv_config(group_size, device)
        block_m = triton.next_power_of_2(max(m, 1))
        num_tiles, block_k = triton.cdiv(n, block_n), group_size
        kernel = "w4a16_gemv"
    else:
        if weight_bits == 4:
            block_k = group_size
        elif INTERPRETED or tensor_core_dots(itemsize, device):
            block_k = W8_BLOCK_K
        else:  # on the CUDA cores a [128, BLOCK_N] weight tile would spill registers
            block_k = 32
        block_m, block_n, num_warps, num_stages = _tile_config(
            m, block_k, itemsize, weight_bits, device
        )
        num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        kernel = f"w{weight_bits}a16"
    split_k = choose_split_k(num_tiles, triton.cdiv(k, block_k), sm_count(device))
    return MatmulPlan(kernel, block_m, block_n, block_k, num_warps, num_stages, split_k)


def _launch(
    x, weight, scales, zeros, n: int, weight_bits: int, group_size: int | None
) -> torch.Tensor:
    """Follow the plan: launch, then add up the split-K partial sums."""
    m, k = x.shape
    plan = plan_quant_matmul(m, n, k, x.element_size(), weight_bits, group_size, x.device)
    # partial sums in float32, added in a fixed order afterwards: deterministic, no atomics
    split_k = plan.split_k
    out = torch.empty(
        split_k, m, n, dtype=x.dtype if split_k == 1 else torch.float32, device=x.device
    )
    # W4A16 takes the zero points (or None) after the scales
    args = (
        (x, weight, scales, out, m, n, k)
        if weight_bits == 8
        else (x, weight, scales, zeros, out, m, n, k)
    )
    launch = dict(num_warps=plan.num_warps, num_stages=plan.num_stages, SPLIT_K=split_k)
    if plan.kernel == "w4a16_gemv":
        grid = (triton.cdiv(n, plan.block_n), split_k)
        _w4a16_gemv_kernel[grid](
            *args,
            GROUP_SIZE=group_size,
            BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n,
            NUM_STAGES=plan.num_stages,
            **launch,
        )
    else:
        grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), split_k)
        tiles = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n)
        dot_fp32 = INTERPRETED or x.dtype == torch.float32
        if weight_bits == 8:
            _w8a16_kernel[grid](*args, DOT_FP32=dot_fp32, BLOCK_K=plan.block_k, **tiles, **launch)
        else:
            _w4a16_kernel[grid](*args, DOT_FP32=dot_fp32, GROUP_SIZE=group_size, **tiles, **launch)
    if split_k == 1:
        return out[0]
    result = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
        out, result, m * n, SPLIT_K=split_k, BLOCK=SUM_BLOCK, num_warps=4
    )
    return result


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: [M, K] float16/bfloat16 (float32 for testing); qweight: [N, K] int8; scales: [N] in
    x's dtype -> y = x (qweight * scales)^T: [M, N] in x's dtype."""
    _check_activations(x)
    m, k = x.shape
    _check_matmul_inputs(x, "qweight", qweight, torch.int8, k, scales, None)
    n = qweight.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=x.dtype, device=x.device)
    return _launch(x, qweight, scales, None, n, 8, None)


def w4a16_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = DEFAULT_GROUP_SIZE,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] float16/bfloat16 (float32 for testing); packed: [N, K / 2] uint8 from
    `quantize_w4` (nibbles u in [0, 15]); scales: [K / group_size, N] in x's dtype;
    group_size: a power of two, 32 to 256; zeros: the zero points z, [K / group_size, N]
    uint8 in [0, 15], or None for the symmetric grid (z = 8) -> y = x W^T [M, N] in x's
    dtype, W[n, k] = s * (u - z) for k's group."""
    _check_activations(x)
    m, k = x.shape
    if group_size not in (32, 64, 128, 256):
        raise ValueError(f"group_size must be 32, 64, 128 or 256, got {group_size}")
    if k % group_size:
        raise ValueError(f"x's K ({k}) must be a multiple of group_size ({group_size})")
    _check_matmul_inputs(x, "packed", packed, torch.uint8, k // 2, scales, k // group_size)
    n = packed.shape[0]
    if zeros is not None:
        check_dtype("zeros", zeros, (torch.uint8,))
        check_shape("zeros", zeros, (k // group_size, n))
        check_same_device("zeros", zeros, x)
        check_contiguous("zeros", zeros)
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=x.dtype, device=x.device)
    return _launch(x, packed, scales, zeros, n, 4, group_size)


def w8a16_matmul_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """The oracle and the PyTorch baseline's recipe: dequantize, then matmul (float64)."""
    return (x.double() @ dequantize_w8(qweight, scales).double().T).to(x.dtype)


def w4a16_matmul_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: unpack, dequantize, then matmul (float64)."""
    w = dequantize_w4(packed, scales, group_size, zeros)
    return (x.double() @ w.double().T).to(x.dtype)


def quant_matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs one call does: a multiply and an add per (m, n, k)."""
    return 2 * m * n * k


def quant_matmul_bytes(
    m: int, n: int, k: int, itemsize: int, weight_bits: int, group_size: int | None
) -> int:
    """Bytes one call moves: x in, y out, the quantized weights and their scales once
    (group_size None: one scale per output channel)."""
    num_scales = n if group_size is None else n * (k // group_size)
    return (m * k + m * n + num_scales) * itemsize + n * k * weight_bits // 8
