"""The checks of chapter 2's exercises reject plausible wrong answers.

As in test_ch00_conventions: the solution's non-graded cells run in this process, then each
graded cell runs with the solution (it must pass), with the stub (NotImplementedError), and
with each wrong answer in the solution's place (it must fail with an AssertionError).
"""

from __future__ import annotations

import math
import time

from minillm.lab import roofline
from minillm.lab.catalog import get_model_config
from minillm.sampling_params import SamplingParams

from .conftest import ROOT
from .exercise_checks import ExerciseChecks, FromNamespace


def gemm(flops_per_mac=2, count_activations=True, bits=False, inverted=False):
    def gemm_cost(m, k, n, element_bytes):
        flops = flops_per_mac * m * k * n
        elements = m * k + k * n + m * n if count_activations else k * n
        num_bytes = elements * element_bytes * (8 if bits else 1)
        return flops, num_bytes, num_bytes / flops if inverted else flops / num_bytes

    return gemm_cost


def weights_only_tokens(k, n, element_bytes, target):
    """Intensity 2m/b when only the weight is counted: m = ceil(target * b / 2)."""
    return max(1, math.ceil(target * element_bytes / 2))


def shifted(name, by):
    return FromNamespace(lambda ns: lambda *a: None if ns[name](*a) is None else ns[name](*a) + by)


def never_none(name, fallback):
    return FromNamespace(lambda ns: lambda *a: fallback if ns[name](*a) is None else ns[name](*a))


def decode_ops_with(mha=False, context_offset=0, attention_flops_per_pair=4, lm_head_per_token=1):
    """The solution's decode_ops with one mistake: ignoring GQA, the context, 2 FLOPs, ..."""

    def decode_ops(config, batch_size, context_len, element_bytes):
        layers, h, d = config.num_hidden_layers, config.hidden_size, config.head_dim
        q_size = config.num_attention_heads * d
        kv_heads = config.num_attention_heads if mha else config.num_key_value_heads
        kv_size = kv_heads * d
        inter, vocab, b, t = config.intermediate_size, config.vocab_size, element_bytes, batch_size
        ctx = context_len + context_offset
        qkv_out = q_size + 2 * config.num_key_value_heads * d
        return {
            "qkv_proj": (layers * 2 * t * h * qkv_out, layers * (h * qkv_out + h) * b, 0),
            "attention": (
                layers * batch_size * ctx * attention_flops_per_pair * q_size,
                0,
                layers * batch_size * ctx * 2 * kv_size * b,
            ),
            "o_proj": (layers * 2 * t * q_size * h, layers * q_size * h * b, 0),
            "mlp": (layers * 3 * 2 * t * h * inter, layers * (3 * h * inter + h) * b, 0),
            "lm_head": (2 * batch_size * lm_head_per_token * h * vocab, (h * vocab + h) * b, 0),
        }

    return decode_ops


def ignores_kv_batch(weight_bytes, flops_per_seq, kv_bytes_per_seq, peak, bandwidth):
    return math.ceil(peak / bandwidth * weight_bytes / flops_per_seq)


def mean_time_s(fn, repeats):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def no_warmup_time_s(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def per_op_with(how="max", bytes_of="all", bound="strict"):
    """The solution's per_op_floor_s with one mistake."""

    def per_op_floor_s(step, peak, bw):
        if how == "whole":
            whole_s = max(step.flops / peak, step.bytes / bw)
            return whole_s, {
                op.name: "compute" if op.flops / peak > op.bytes / bw else "memory"
                for op in step.ops
            }
        total, bounds = 0.0, {}
        for op in step.ops:
            num_bytes = op.bytes if bytes_of == "all" else op.weight_bytes + op.kv_bytes
            compute_s, memory_s = op.flops / peak, num_bytes / bw
            total += compute_s + memory_s if how == "sum" else max(compute_s, memory_s)
            is_compute = compute_s > memory_s
            if bound == "inverted":
                is_compute = not is_compute
            bounds[op.name] = "compute" if is_compute else "memory"
        return total, bounds

    return per_op_floor_s


def first_batch_with(whole_bytes="all", offset=0, never_none=False):
    """The solution's first_batch_apart with one mistake."""

    def first_batch_apart(config, context_len, dtype, peak, bw, max_batch=2048):
        for b in range(1, max_batch + 1):
            s = roofline.decode_step_cost(config, b, context_len, dtype)
            num_bytes = s.bytes if whole_bytes == "all" else s.min_bytes
            per_op = sum(max(op.flops / peak, op.bytes / bw) for op in s.ops)
            if per_op > 1.1 * max(s.flops / peak, num_bytes / bw):
                return b + offset
        return max_batch if never_none else None

    return first_batch_apart


def decode_timer(how="fastest", max_tokens_extra=1, unit_s=1.0, busy_prefill_s=0.0):
    """The solution's fastest_decode_step_s with one mistake. `busy_prefill_s` makes the
    prefill step that long, as on a loaded machine: then the fastest of the readings is a
    decode step even when the prefill is timed too, and only the check's record of what
    each reading enclosed tells the mistake."""

    def fastest_decode_step_s(engine, prompts, repeats):
        if busy_prefill_s:
            engine = BusyFirstStep(engine, busy_prefill_s)
        params = SamplingParams(
            temperature=0.0, max_tokens=repeats + max_tokens_extra, ignore_eos=True
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        if how == "constant":
            while engine.has_unfinished_requests():
                engine.step()
            return 0.015
        times = []
        if how == "with prefill":
            repeats += 1
        else:
            engine.step()
        for _ in range(repeats):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        if how == "mean":
            return sum(times) / len(times)
        if how == "first":
            return times[0]
        if how == "total":
            return sum(times)
        return min(times) * unit_s

    return fastest_decode_step_s


class BusyFirstStep:
    """An engine whose first step (the prefill) also waits `seconds`."""

    def __init__(self, engine, seconds):
        self.engine, self.seconds, self.steps = engine, seconds, 0

    def step(self):
        outputs = self.engine.step()
        if self.steps == 0:
            time.sleep(self.seconds)
        self.steps += 1
        return outputs

    def __getattr__(self, name):
        return getattr(self.engine, name)


def utilization_with(kv=True, activations=False, percent=False):
    """The solution's utilization with one mistake."""

    def utilization(config, batch_size, context_len, step_time_s, peak, bw, dtype="bfloat16"):
        step = roofline.decode_step_cost(config, batch_size, context_len, dtype)
        num_bytes = step.weight_bytes + (step.kv_bytes if kv else 0)
        if activations:
            num_bytes = step.bytes
        scale = 100 if percent else 1
        return scale * step.flops / step_time_s / peak, scale * num_bytes / step_time_s / bw

    return utilization


def highest_intensity_op():
    cost = roofline.decode_step_cost(get_model_config("Llama 3.1 8B"), 64, 4096)
    return max(cost.ops, key=lambda op: op.intensity).name


def first_op_name():
    return "qkv_proj"


WRONG_ANSWERS = {
    "gemm_cost": {
        "one FLOP per multiply-add": gemm(flops_per_mac=1),
        "weight bytes only": gemm(count_activations=False),
        "bits, not bytes": gemm(bits=True),
        "bytes per FLOP": gemm(inverted=True),
    },
    "tokens_to_reach": {
        "weight bytes only": weights_only_tokens,
        "one token too many": shifted("tokens_to_reach", 1),
        "one token too few": shifted("tokens_to_reach", -1),
        "never None": never_none("tokens_to_reach", 10**9),
    },
    "ridge_from_datasheet": {
        "sparse figure taken as dense": lambda tf, sparse, bw: tf / bw,
        "always halved": lambda tf, sparse, bw: tf / 2 / bw,
        "bandwidth read as GB/s": lambda tf, sparse, bw: (
            tf * 1e12 / (2 if sparse else 1) / (bw * 1e9)
        ),
        "bytes per FLOP": lambda tf, sparse, bw: bw / (tf / (2 if sparse else 1)),
    },
    "decode_ops": {
        "K and V with every query head": decode_ops_with(mha=True),
        "context without the new token": decode_ops_with(context_offset=-1),
        "2 FLOPs per query-key pair": decode_ops_with(attention_flops_per_pair=2),
        "LM head over the whole context": FromNamespace(
            lambda ns: (
                lambda c, bsz, ctx, b: {
                    **ns["decode_ops"](c, bsz, ctx, b),
                    "lm_head": (
                        2 * bsz * ctx * c.hidden_size * c.vocab_size,
                        *ns["decode_ops"](c, bsz, ctx, b)["lm_head"][1:],
                    ),
                }
            )
        ),
    },
    "decode_floor_s": {
        "weights only": lambda w, kv, bsz, ctx, bw: w / bw,
        "one sequence's KV": lambda w, kv, bsz, ctx, bw: (w + ctx * kv) / bw,
        "weights read per sequence": lambda w, kv, bsz, ctx, bw: bsz * (w + ctx * kv) / bw,
    },
    "compute_bound_batch": {
        "KV bytes ignored": ignores_kv_batch,
        "one too many": shifted("compute_bound_batch", 1),
        "never None": never_none("compute_bound_batch", 1),
    },
    "per_op_floor_s": {
        "the whole step's floor": per_op_with(how="whole"),
        "sum of each op's two floors": per_op_with(how="sum"),
        "weights and KV only": per_op_with(bytes_of="min"),
        "bounds swapped": per_op_with(bound="inverted"),
    },
    "first_batch_apart": {
        "whole-step floor from min_bytes": first_batch_with(whole_bytes="min"),
        "one batch too many": first_batch_with(offset=1),
        "one batch too few": first_batch_with(offset=-1),
        "never None": first_batch_with(never_none=True),
    },
    "fastest_decode_step_s": {
        "mean, not the fastest": decode_timer("mean"),
        "the first decode step": decode_timer("first"),
        "prefill timed too": decode_timer("with prefill"),
        "prefill timed too, on a busy machine": decode_timer("with prefill", busy_prefill_s=0.6),
        "a made-up time": decode_timer("constant"),
        "all the steps together": decode_timer("total"),
        "milliseconds": decode_timer(unit_s=1e3),
        "requests outlive the timed steps": decode_timer(max_tokens_extra=5),
    },
    "utilization": {
        "weights only": utilization_with(kv=False),
        "activations counted": utilization_with(activations=True),
        "percentages": utilization_with(percent=True),
    },
    "best_time_s": {
        "mean, not the fastest": mean_time_s,
        "no warm-up call": no_warmup_time_s,
    },
    "bytes_read_by_sum": {
        "elements, not bytes": lambda x: x.numel(),
        "bits, not bytes": lambda x: x.numel() * x.element_size() * 8,
        "always 4 bytes per element": lambda x: x.numel() * 4,
    },
    "lowest_intensity_op": {
        "the highest": highest_intensity_op,
        "the first": first_op_name,
    },
    "longest_compute_bound_context": {
        "one past the end": shifted("longest_compute_bound_context", 1),
        "one short": shifted("longest_compute_bound_context", -1),
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch02_roofline.ipynb"
    EXERCISE = ROOT / "exercises" / "ch02_roofline.ipynb"
    POINTS = [3, 4, 2, 2, 4, 3, 4, 2]
    WRONG_ANSWERS = WRONG_ANSWERS
