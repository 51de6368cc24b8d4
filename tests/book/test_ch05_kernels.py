"""The checks of chapter 5's exercises reject plausible wrong answers.

As for chapter 4: the solution's non-graded cells run in this process, then each graded cell
runs with the solution (it must pass), with the stub (NotImplementedError), and with each
wrong answer in the solution's place (it must fail with an AssertionError).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

import kernels  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA, before triton loads)

# isort: split
import triton
import triton.language as tl

from kernels.device import ARCH_LIMITS
from minillm.lab.op_trace import trace_ops

from .conftest import ROOT
from .exercise_checks import ExerciseChecks, FromNamespace


def float64_scalar(x):
    """The right lse as a 0-d float64 tensor, not a Python float."""
    return torch.tensor(x, dtype=torch.float64)


def online(
    rescale_acc=True,
    rescale_sum=True,
    subtract_max=True,
    keep_last=True,
    scaled=True,
    first_max=-math.inf,
    lse_type=float,
):
    """The online softmax with one thing left out."""

    def online_attention(q, k, v, block_size):
        scale = 1 / math.sqrt(q.shape[0]) if scaled else 1.0
        n = k.shape[0] if keep_last else k.shape[0] - k.shape[0] % block_size
        m, total = first_max, 0.0
        acc = torch.zeros_like(q)
        for start in range(0, n, block_size):
            s = (k[start : start + block_size] @ q) * scale
            m_new = max(m, s.max().item()) if subtract_max else 0.0
            alpha = math.exp(m - m_new) if subtract_max else 1.0
            p = torch.exp(s - m_new)
            total = total * (alpha if rescale_sum else 1.0) + p.sum().item()
            acc = acc * (alpha if rescale_acc else 1.0) + p @ v[start : start + block_size]
            m = m_new
        if total == 0.0:
            return torch.full_like(q, math.nan), math.nan
        return acc / total, lse_type(m + math.log(total))

    return online_attention


def whole_softmax(q, k, v, block_size):
    """Right values, computed over all the keys at once: block_size is ignored."""
    scores = (k @ q) / math.sqrt(q.shape[0])
    return torch.softmax(scores, dim=0) @ v, torch.logsumexp(scores, dim=0).item()


def blockwise_average(q, k, v, block_size):
    """Softmax within each block, then the plain mean of the blocks' outputs."""
    scores = (k @ q) / math.sqrt(q.shape[0])
    outs = [
        torch.softmax(scores[i : i + block_size], dim=0) @ v[i : i + block_size]
        for i in range(0, k.shape[0], block_size)
    ]
    return torch.stack(outs).mean(0), torch.logsumexp(scores, dim=0).item()


def merge(weights, lse_of=None, guard_empty=True, lse_type=float):
    """A merge with the given weights; lse_of(lses, weights) replaces the right lse."""

    def merge_partials(outs, lses):
        top = lses.max().item()
        if guard_empty and top == -math.inf:
            return torch.zeros_like(outs[0]), -math.inf
        w = weights(lses, top)
        out = (w[:, None] * outs).sum(0) / w.sum()
        lse = top + math.log(torch.exp(lses - top).sum().item()) if lse_of is None else lse_of(lses)
        return out, lse_type(lse)

    return merge_partials


def attention_bytes_with(passes=4, matrix_heads="q", kv_heads="kv", bits=False):
    def attention_bytes(seq_len, num_heads, num_kv_heads, head_dim, itemsize):
        kv = num_kv_heads if kv_heads == "kv" else num_heads
        compulsory = (2 * seq_len * num_heads + 2 * seq_len * kv) * head_dim * itemsize
        heads = num_heads if matrix_heads == "q" else num_kv_heads
        unfused = passes * heads * seq_len * seq_len * itemsize + compulsory
        factor = 8 if bits else 1
        return unfused * factor, compulsory * factor

    return attention_bytes


def splits_with(fill=2, min_keys=True, bounded=True, round_up=True):
    def choose_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, min_keys_per_split, max_splits):
        programs = num_seqs * num_kv_heads
        wanted = -(-fill * num_sms // programs) if round_up else fill * num_sms // programs
        limits = [wanted]
        if min_keys:
            limits.append(max(-(-max_seq_len // min_keys_per_split), 1))
        if bounded:
            limits.append(max_splits)
        return max(1, min(limits))

    return choose_splits


def pack_with(swap=False, offset=True, mask=True, halves=False, dtype=torch.uint8):
    def pack_int4(q):
        if offset:
            nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
        elif mask:
            nibbles = q.to(torch.uint8) & 0xF
        else:
            nibbles = q.to(torch.uint8)
        half = q.shape[1] // 2
        low, high = (
            (nibbles[:, :half], nibbles[:, half:])
            if halves
            else (nibbles[:, 0::2], nibbles[:, 1::2])
        )
        if swap:
            low, high = high, low
        return (low | (high << 4)).to(dtype)

    return pack_int4


def w4_bytes_with(num_scales, weight_bytes_per_weight=0.5):
    def w4a16_matmul_bytes(m, n, k, group_size):
        scales = num_scales(n, k, group_size)
        return (m * k + m * n + scales) * 2 + int(n * k * weight_bytes_per_weight)

    return w4a16_matmul_bytes


def right_bf16_bytes(m, n, k):
    return (m * k + n * k + m * n) * 2


def right_w4_bytes(m, n, k, group_size):
    return (m * k + m * n + n * (k // group_size)) * 2 + n * k // 2


def speedup_from_bytes(m, n, k, group_size, peak, bandwidth):
    return right_bf16_bytes(m, n, k) / right_w4_bytes(m, n, k, group_size)


def inverted_speedup(m, n, k, group_size, peak, bandwidth):
    compute_s = 2 * m * n * k / peak
    bf16_s = max(compute_s, right_bf16_bytes(m, n, k) / bandwidth)
    return max(compute_s, right_w4_bytes(m, n, k, group_size) / bandwidth) / bf16_s


def occupancy_with(
    reserved=True, round_registers=True, program_limit=True, per_program=False, reserve_once=False
):
    def programs_per_sm(compute_capability, num_warps, shared_bytes, registers_per_thread):
        arch = ARCH_LIMITS[compute_capability]
        limits = [arch.max_warps_per_sm // num_warps]
        if program_limit:
            limits.append(arch.max_programs_per_sm)
        if shared_bytes:
            extra = arch.reserved_shared_memory_per_program if reserved else 0
            if reserve_once:
                limits.append((arch.shared_memory_per_sm - extra) // shared_bytes)
            else:
                limits.append(arch.shared_memory_per_sm // (shared_bytes + extra))
        if registers_per_thread:
            unit = arch.register_allocation_unit if round_registers else 1
            if per_program:
                need = -(-32 * registers_per_thread * num_warps // unit) * unit
                limits.append(arch.registers_per_sm // need)
            else:
                per_warp = -(-32 * registers_per_thread // unit) * unit
                limits.append(arch.registers_per_sm // per_warp // num_warps)
        return min(limits)

    return programs_per_sm


def distinct_op_names(engine):
    _, ops = trace_ops(engine.step)
    return len({op.name for op in ops})


def matmuls_only(engine):
    _, ops = trace_ops(engine.step)
    return sum(op.name.split(".")[0] in ("linear", "mm", "addmm", "bmm", "matmul") for op in ops)


def two_steps_traced(engine):
    _, ops = trace_ops(lambda: (engine.step(), engine.step()))
    return len(ops)


def timed_steps(engine, num_steps, warm_up=True):
    if warm_up:
        engine.step()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def made_up_time(engine, num_steps):
    for _ in range(num_steps + 1):
        engine.step()
    return 0.015


def made_up_for_the_real_engine(engine, num_steps):
    """Times the stand-in engines honestly, and makes up a long time for the real one."""
    engine.step()
    best = math.inf
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - start)
    return best if type(engine).__name__ == "SleepingEngine" else 0.5


def time_between_steps(engine, num_steps):
    """Times the gap after each step, not the step itself."""
    engine.step()
    best = math.inf
    for _ in range(num_steps):
        engine.step()
        start = time.perf_counter()
        best = min(best, time.perf_counter() - start)
    return best


def warm_up_included(engine, num_steps):
    start = time.perf_counter()
    engine.step()
    return min(time.perf_counter() - start, *timed_steps(engine, num_steps, warm_up=False))


def next_power_of_two(num_seqs, max_num_seqs):
    if num_seqs > max_num_seqs:
        return None
    return min(1 << (num_seqs - 1).bit_length(), max_num_seqs)


def right_bucket(num_seqs, max_num_seqs):
    buckets = sorted({1, 2, 4, *range(8, max_num_seqs, 8), max_num_seqs})
    return next((s for s in buckets if num_seqs <= s <= max_num_seqs), None)


def rounded_down(num_seqs, max_num_seqs):
    if num_seqs > max_num_seqs:
        return None
    buckets = sorted({1, 2, 4, *range(8, max_num_seqs, 8), max_num_seqs})
    return max(s for s in buckets if s <= num_seqs)


def one_graph(num_seqs, max_num_seqs):
    return max_num_seqs if num_seqs <= max_num_seqs else None


def padded_with(bucket, count_steps=False):
    def padded_rows(batch_sizes, max_num_seqs):
        total = 0
        for n in batch_sizes:
            b = bucket(n, max_num_seqs)
            if b is not None:
                total += (b > n) if count_steps else b - n
        return total

    return padded_rows


@triton.jit
def unmasked_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """silu(g) * u with no mask at all: the last block reads and writes past the end."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(gate_ptr + offsets).to(tl.float32)
    u = tl.load(up_ptr + offsets).to(tl.float32)
    tl.store(out_ptr + offsets, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty))


@triton.jit
def store_unmasked_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """Masked loads, but the store of the last block writes past the end."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty))


@triton.jit
def gate_times_up_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """g * u: the silu left out."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (g * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sigmoid_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """sigmoid(g) * u: silu's factor g left out."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def not_a_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK=128):
    """A plain Python function with the kernel's signature."""
    out_ptr.copy_(F.silu(gate_ptr) * up_ptr)


def silu_mul_with(grid_of=triton.cdiv, out_dtype=None, into_gate=False):
    """The launcher with one thing wrong, launching the notebook's own kernel."""

    def factory(namespace):
        def silu_mul(gate, up, block=128):
            out = gate if into_gate else torch.empty_like(gate, dtype=out_dtype or gate.dtype)
            n = gate.numel()
            namespace["silu_mul_kernel"][(grid_of(n, block),)](gate, up, out, n, BLOCK=block)
            return out

        return silu_mul

    return FromNamespace(factory)


WRONG_ANSWERS = {
    "online_attention": {
        "accumulator not rescaled": online(rescale_acc=False),
        "sum not rescaled": online(rescale_sum=False),
        "no max subtracted": online(subtract_max=False),
        "each block normalized, then averaged": blockwise_average,
        "last partial block dropped": online(keep_last=False),
        "no 1/sqrt(d) scale": online(scaled=False),
        "all the keys at once, not block by block": whole_softmax,
        "running max started at 0, not -inf": online(first_max=0.0),
        "lse as a 0-d tensor": online(lse_type=float64_scalar),
    },
    "merge_partials": {
        "plain average": merge(lambda lses, top: torch.ones_like(lses)),
        "e^lse without the max": merge(lambda lses, top: torch.exp(lses)),
        "weights lse": merge(lambda lses, top: lses),
        "all pieces empty give NaN": merge(
            lambda lses, top: torch.exp(lses - top), guard_empty=False
        ),
        "lse = the largest lse": merge(
            lambda lses, top: torch.exp(lses - top), lse_of=lambda lses: lses.max().item()
        ),
        "lse as a 0-d tensor": merge(
            lambda lses, top: torch.exp(lses - top), lse_type=float64_scalar
        ),
    },
    "attention_bytes": {
        "two passes over the score matrix": attention_bytes_with(passes=2),
        "one score matrix per KV head": attention_bytes_with(matrix_heads="kv"),
        "bits, not bytes": attention_bytes_with(bits=True),
        "K and V with every query head": attention_bytes_with(kv_heads="q"),
    },
    "choose_splits": {
        "fills the SMs once": splits_with(fill=1),
        "no minimum split length": splits_with(min_keys=False),
        "no upper bound": splits_with(bounded=False),
        "wanted splits rounded down": splits_with(round_up=False),
    },
    "decode_programs": {
        "one program per sequence": lambda num_seqs, num_kv_heads: num_seqs,
        "one program per query head": lambda num_seqs, num_kv_heads: 4 * num_seqs * num_kv_heads,
    },
    "smallest_filling_batch": {
        "rounded down": lambda num_sms, num_kv_heads: num_sms // num_kv_heads,
        "one program per sequence": lambda num_sms, num_kv_heads: num_sms,
        "query heads counted": lambda num_sms, num_kv_heads: -(-num_sms // (4 * num_kv_heads)),
    },
    "pack_int4": {
        "swapped nibbles": pack_with(swap=True),
        "two's complement nibbles": pack_with(offset=False),
        "negative values not masked": pack_with(offset=False, mask=False),
        "halves of the row, not neighbours": pack_with(halves=True),
        "int8 bytes": pack_with(dtype=torch.int8),
    },
    "bf16_matmul_bytes": {
        "weights only": lambda m, n, k: n * k * 2,
    },
    "w4a16_matmul_bytes": {
        "no scales": w4_bytes_with(lambda n, k, g: 0),
        "a scale per weight": w4_bytes_with(lambda n, k, g: n * k),
        "scales of one row only": w4_bytes_with(lambda n, k, g: k // g),
        "a byte per 4-bit weight": w4_bytes_with(lambda n, k, g: n * (k // g), 1),
        "a float count of bytes": lambda m, n, k, g: float(right_w4_bytes(m, n, k, g)),
    },
    "floor_speedup": {
        "ratio of bytes, compute ignored": speedup_from_bytes,
        "W4A16 floor over bfloat16 floor": inverted_speedup,
    },
    "programs_per_sm": {
        "no reserved shared memory": occupancy_with(reserved=False),
        "registers not rounded": occupancy_with(round_registers=False),
        "no limit on programs": occupancy_with(program_limit=False),
        "registers rounded per program": occupancy_with(per_program=True),
        "reserved shared memory once per SM": occupancy_with(reserve_once=True),
    },
    "ops_per_decode_step": {
        "distinct operation names": distinct_op_names,
        "matrix multiplies only": matmuls_only,
        "two steps traced": two_steps_traced,
    },
    "fixed_cost_s": {
        "mean over the sizes": lambda times: sum(times.values()) / len(times),
        "the largest size": lambda times: times[max(times)],
        "the fastest size": lambda times: min(times.values()),
        "the first entry": lambda times: next(iter(times.values())),
    },
    "best_step_time_s": {
        "mean, not the fastest": lambda engine, n: sum(timed_steps(engine, n)) / n,
        "no warm-up step": lambda engine, n: min(timed_steps(engine, n, warm_up=False)),
        "warm-up step timed too": warm_up_included,
        "a made-up time": made_up_time,
        "a made-up time for the real engine": made_up_for_the_real_engine,
        "the gap between steps timed": time_between_steps,
    },
    "fixed_cost_share": {
        "step time over fixed cost": lambda n, cost, step: step / (n * cost),
        "a percentage": lambda n, cost, step: 100 * n * cost / step,
        "one operation": lambda n, cost, step: cost / step,
    },
    "graph_bucket": {
        "next power of two": next_power_of_two,
        "rounded down": rounded_down,
        "never eager": lambda n, max_num_seqs: right_bucket(min(n, max_num_seqs), max_num_seqs),
    },
    "padded_rows": {
        "power-of-two buckets": padded_with(next_power_of_two),
        "every batch padded to max_num_seqs": padded_with(one_graph),
        "steps that pad, not rows": padded_with(right_bucket, count_steps=True),
    },
    "silu_mul_kernel": {
        "no mask": unmasked_kernel,
        "the store unmasked": store_unmasked_kernel,
        "g * u, no silu": gate_times_up_kernel,
        "sigmoid(g) * u": sigmoid_kernel,
        "a Python function, not a kernel": not_a_kernel,
    },
    "silu_mul": {
        "PyTorch, no kernel": lambda gate, up, block=128: F.silu(gate) * up,
        "programs rounded down": silu_mul_with(grid_of=lambda n, block: n // block),
        "written into the gate": silu_mul_with(into_gate=True),
        "a float32 output": silu_mul_with(out_dtype=torch.float32),
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch05_kernels.ipynb"
    EXERCISE = ROOT / "exercises" / "ch05_kernels.ipynb"
    POINTS = [4, 3, 3, 3, 2, 2, 3, 3, 4, 2, 3]
    WRONG_ANSWERS = WRONG_ANSWERS
