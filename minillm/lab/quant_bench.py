"""Quantization on a CPU: perplexity, weight bytes and decode speed, side by side in one run.

    python -m minillm.lab.quant_bench            # writes benchmarks/results/quantization_cpu.json

The bundled target model runs through the engine (`LLM`) in float32 and bfloat16 and,
quantized from its float32 weights, as W8A16 (int8 weights, RTN), W4A16 (int4 weights per
group of 128: RTN, GPTQ with and without act-order, AWQ), FP8 weight-only (E4M3 weights)
and W8A8 (int8 weights and per-token int8 activations, with and without SmoothQuant). For
each: perplexity on the held-out windows beside the model and each window's mean
cross-entropy (from which `minillm.lab.bootstrap` draws intervals), greedy agreement with
the float32 model on 8 held-out prompts (outputs identical, and the mean share of each
output before its first difference), the bytes of its weights, and batch-1 decode
speed (1 / TPOT) repeated round robin over the variants, so that a slow moment of a shared
machine hits all of them alike; the median and the range of the repeats are reported.

What the speed measures here: on a CPU the quantized layers dequantize their weights on
every call and then run an ordinary float matmul, and a tiny model's step is dominated by
per-step overhead, so quantization makes decoding slower, not faster. The saving it buys on
a CPU is memory. On a GPU, where a batch-1 decode step is bound by reading the weights, the
W4A16 kernel reads a quarter of bfloat16's bytes (see chapter 5 and `kernels.quant_matmul`).

The goal recorded for GPTQ: W4A16 GPTQ loses at most half the perplexity that W4A16 RTN
loses (both against the float32 model they were quantized from).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from minillm.lab.bench import machine_record
from minillm.lab.recorded import RESULTS_DIR, weights_record

MODEL = "minillm-stdlib-target"
GOAL_RATIO = 0.5  # GPTQ's perplexity loss / RTN's perplexity loss, at most
# what each `quantization=` option is, by the field's names
FORMAT_NAMES = {"int8": "W8A16", "int4": "W4A16", "fp8": "FP8 weight-only", "w8a8": "W8A8"}


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    dtype: str
    quantization: str | None = None
    method: str = "rtn"
    act_order: bool = True  # GPTQ only


VARIANTS = (
    Variant("float32", "float32"),
    Variant("bfloat16", "bfloat16"),
    Variant("W8A16 RTN", "float32", "int8"),
    Variant("W4A16 RTN", "float32", "int4"),
    Variant("W4A16 GPTQ", "float32", "int4", "gptq"),
    Variant("W4A16 GPTQ, no act-order", "float32", "int4", "gptq", act_order=False),
    Variant("W4A16 AWQ", "float32", "int4", "awq"),
    Variant("FP8 weight-only", "float32", "fp8"),
    Variant("W8A8 RTN", "float32", "w8a8"),
    Variant("W8A8 SmoothQuant", "float32", "w8a8", "smoothquant"),
)


def build(variant: Variant, calibration: torch.Tensor, group_size: int):
    """An LLM whose model is quantized in place after loading; returns (llm, seconds spent
    quantizing)."""
    from minillm.llm import LLM
    from minillm.model.quantization import quantize_model

    llm = LLM(
        MODEL, dtype=variant.dtype, device="cpu", num_gpu_blocks=64, enable_prefix_caching=False
    )
    start = time.perf_counter()
    if variant.quantization is not None:
        quantize_model(
            llm.engine.model_runner.model,
            variant.quantization,
            group_size,
            variant.method,
            None if variant.method == "rtn" else calibration,
            variant.act_order,
        )
    return llm, time.perf_counter() - start


def decode_tokens_per_s(llm, prompt: list[int], max_tokens: int) -> float:
    """Batch-1 greedy decode speed: 1 / TPOT, the time per output token after the first."""
    from minillm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    return 1.0 / output.metrics.tpot_s


GREEDY_PROMPTS = 8  # held-out windows whose first 32 tokens prompt the greedy comparison
GREEDY_TOKENS = 32


def greedy_outputs(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of the prompts, batched."""
    from minillm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How far greedy outputs follow the reference's: outputs identical, and the mean share
    of each output before its first differing token."""
    prefixes = []
    for out, ref in zip(outputs, reference, strict=True):
        same = 0
        while same < min(len(out), len(ref)) and out[same] == ref[same]:
            same += 1
        prefixes.append(same / max(len(ref), 1))
    return {
        "identical": sum(out == ref for out, ref in zip(outputs, reference, strict=True)),
        "prompts": len(reference),
        "common_prefix": sum(prefixes) / len(prefixes),
    }


def run(
    variants: tuple[Variant, ...] = VARIANTS,
    repeats: int = 5,
    num_windows: int | None = None,
    calibration_tokens: int = 8192,
    max_tokens: int = 64,
    group_size: int = 128,
) -> dict:
    """Measure every variant; returns a JSON-ready record (prints a table as it goes)."""
    from minillm.model.loader import resolve_model_path
    from minillm.model.perplexity import heldout_windows, window_cross_entropy
    from minillm.model.quantization import default_calibration, weight_bytes

    path = resolve_model_path(MODEL)
    windows = heldout_windows(path)[:num_windows]
    calibration = default_calibration(path, calibration_tokens)
    prompt = windows[0, :32].tolist()
    greedy_prompts = [w[:32].tolist() for w in windows[:GREEDY_PROMPTS]]
    greedy = {}
    built = {}
    results = {}
    for variant in variants:
        llm, quantize_s = build(variant, calibration, group_size)
        model = llm.engine.model_runner.model
        built[variant.name] = llm
        greedy[variant.name] = greedy_outputs(llm, greedy_prompts, GREEDY_TOKENS)
        decode_tokens_per_s(llm, prompt, 4)  # warm-up
        ce = window_cross_entropy(model, windows)
        results[variant.name] = {
            "dtype": variant.dtype,
            "quantization": variant.quantization,
            "method": variant.method if variant.quantization else None,
            "act_order": variant.act_order if variant.method == "gptq" else None,
            "group_size": group_size if variant.quantization == "int4" else None,
            "format": FORMAT_NAMES.get(variant.quantization, variant.dtype),
            "quantize_s": round(quantize_s, 2),
            "perplexity": math.exp(float(ce.mean())),
            "window_cross_entropy": ce.tolist(),
            "weight_bytes": weight_bytes(model),
            "decode_tokens_per_s": [],
        }
        if "float32" in greedy:  # greedy decoding against the float32 model's
            results[variant.name]["greedy_vs_float32"] = greedy_agreement(
                greedy[variant.name], greedy["float32"]
            )
        print(f"{variant.name}: built, perplexity {results[variant.name]['perplexity']:.3f}")
    load_before = os.getloadavg()[0]
    for _ in range(repeats):  # round robin: every repeat visits every variant once
        for name, llm in built.items():
            results[name]["decode_tokens_per_s"].append(
                decode_tokens_per_s(llm, prompt, max_tokens)
            )
    for r in results.values():
        samples = r["decode_tokens_per_s"]
        r["decode_tokens_per_s_median"] = statistics.median(samples)
        r["decode_tokens_per_s_range"] = [min(samples), max(samples)]
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return record(results, windows, calibration, repeats, max_tokens, group_size, load)


def record(results, windows, calibration, repeats, max_tokens, group_size, load=None) -> dict:
    base = results.get("float32")
    out = {
        **machine_record(),
        "model": MODEL,
        **weights_record(MODEL),
        "heldout": {"num_windows": windows.shape[0], "window_len": windows.shape[1]},
        "calibration": {
            "num_windows": calibration.shape[0],
            "window_len": calibration.shape[1],
            "source": "standard library files other than the held-out ones",
        },
        "decode": {"batch": 1, "prompt_tokens": 32, "max_tokens": max_tokens, "repeats": repeats},
        # the 1-minute load average before and after the timed repeats: other programs
        # sharing the cores slow every variant alike (round robin), not their ratios
        "load_average": load,
        "group_size": group_size,
        "results": results,
    }
    if base is not None:
        for r in results.values():
            r["perplexity_increase"] = r["perplexity"] - base["perplexity"]
            r["bytes_vs_float32"] = r["weight_bytes"] / base["weight_bytes"]
            r["speed_vs_float32"] = (
                r["decode_tokens_per_s_median"] / base["decode_tokens_per_s_median"]
            )
    if base is not None and "W4A16 RTN" in results and "W4A16 GPTQ" in results:
        rtn_loss = results["W4A16 RTN"]["perplexity_increase"]
        gptq_loss = results["W4A16 GPTQ"]["perplexity_increase"]
        out["goal"] = {
            "statement": "W4A16 GPTQ loses at most half the perplexity that W4A16 RTN loses",
            "rtn_perplexity_increase": rtn_loss,
            "gptq_perplexity_increase": gptq_loss,
            "ratio": gptq_loss / rtn_loss if rtn_loss > 0 else None,
            "met": rtn_loss > 0 and gptq_loss <= GOAL_RATIO * rtn_loss,
        }
        plain = results.get("W4A16 GPTQ, no act-order")
        if plain is not None and rtn_loss > 0:
            out["goal"]["ratio_without_act_order"] = plain["perplexity_increase"] / rtn_loss
    return out


def print_table(rec: dict) -> None:
    print(
        f"\n{rec['model']} on {rec['machine']}, {rec['threads']} thread(s); perplexity over "
        f"{rec['heldout']['num_windows']} held-out windows; decode batch 1, median of "
        f"{rec['decode']['repeats']} round-robin repeats [min, max]"
    )
    header = f"{'variant':<24} {'perplexity':>10} {'+ppl':>7} {'weights MiB':>11} {'x f32':>6}"
    print(f"{header} {'decode tok/s':>13} {'[min, max]':>15} {'x f32':>6}")
    for name, r in rec["results"].items():
        low, high = r["decode_tokens_per_s_range"]
        print(
            f"{name:<24} {r['perplexity']:10.3f} {r.get('perplexity_increase', 0):+7.3f} "
            f"{r['weight_bytes'] / 2**20:11.2f} {r.get('bytes_vs_float32', 1):6.3f} "
            f"{r['decode_tokens_per_s_median']:13.1f} {f'[{low:.0f}, {high:.0f}]':>15} "
            f"{r.get('speed_vs_float32', 1):6.2f}"
        )
    goal = rec.get("goal")
    if goal is not None:
        verdict = "met" if goal["met"] else "NOT met"
        # on a few windows RTN can lose nothing (or gain), and then there is no ratio
        ratio = "no ratio" if goal["ratio"] is None else f"ratio {goal['ratio']:.2f}"
        print(
            f"\ngoal: {goal['statement']}: {verdict} (GPTQ {goal['gptq_perplexity_increase']:+.3f}"
            f" vs RTN {goal['rtn_perplexity_increase']:+.3f}, {ratio})"
        )
        if "ratio_without_act_order" in goal:
            print(f"      without act-order the ratio is {goal['ratio_without_act_order']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.lab.quant_bench", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--num-windows", type=int, default=None, help="default: all")
    parser.add_argument("--calibration-tokens", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="default: benchmarks/results/ of a clone")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rec = run(
        repeats=args.repeats,
        num_windows=args.num_windows,
        calibration_tokens=args.calibration_tokens,
        max_tokens=args.max_tokens,
    )
    print_table(rec)
    target = args.json
    if target is None and RESULTS_DIR.is_dir():
        target = RESULTS_DIR / "quantization_cpu.json"
    if target is not None:
        pathlib.Path(target).write_text(json.dumps(rec, indent=2) + "\n")
        print(f"written to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
