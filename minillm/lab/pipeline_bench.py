"""The bubble minillm's pipeline actually has: each step drained, or batches in flight.

Three engines of two stages (`pipeline_parallel_size=2`) serve the same greedy requests: one
cuts every step into two micro-batches and drains the pipeline before the next step
(`pipeline_micro_batches=2`), the others keep two or three batches of different requests in
flight across steps (`pipeline_batches_in_flight=2` or 3). `measure_bubble` runs them in
turns (the order alternates every repeat, after a warm-up run each), and for every run reads
the stages' timings (`LLMEngine.pipeline_stats`), measures the idle share of the stages over
the whole run (`pipeline.run_bubble`) and splits it into its parts (`pipeline.bubble_parts`:
fill and drain, waits for another stage within a step, gaps between steps). A stage is busy
while it does its own work on a batch (taking the plan, preparing the inputs, its layers, on
the last stage the logits and the sampling, handing back the answer: `pipeline.StageTiming`)
and idle while it waits on another process: a stage's hidden states, the next stage, the
engine's next plan. The host work of taking the plan and handing back the answer is also
reported on its own, per batch and stage. Each engine is set against two formulas:

- equal stages (GPipe): every step fills and drains a pipeline of m micro-batches,
  (p - 1) / (m + p - 1); with batches in flight the run's n batches fill and drain it once,
  (p - 1) / (n + p - 1);
- the stages as measured (`pipeline.uneven_bubble_fraction`): each stage's busy time per
  micro-batch (or batch) t_s in 1 - n sum(t) / (p (sum(t) + (n - 1) max(t))), the schedule
  of stages of unequal time, paced by the slowest. The last stage also computes the logits
  and samples, so it is the slower one unless it holds fewer layers (`partition`).

Neither counts what is left: a first stage that waits for the engine to take one batch's
tokens in and plan the next, batches that vary in time from one to the next (a stage that
runs ahead at most one batch cannot always absorb that), and, on a shared machine, other
processes holding the cores. It also checks that every engine gives the one-process
engine's tokens. Speed is measured, never asserted.

On a machine with fewer free cores than processes the stages cannot compute at the same
time, and the bubble measures the machine more than the schedule. `layer_seconds` then
stands in for a device: every stage's forward over a micro-batch also waits that long per
layer the stage holds, as a host waits for a GPU's kernels, which needs no core, so the
stages overlap as they would on their own devices, and a stage with more layers takes
longer, as on a device. The logits and the sampling get no such wait: on the bundled model
(6 layers of hidden size 256, a vocabulary of 4096) they are host work of a millisecond or
two, less than one layer's wait, so no split of whole layers evens the stages better than
equal shares; `--partition 4,2` shows an uneven one against its formula.

    python -m minillm.lab.pipeline_bench --json benchmarks/results/pipeline_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import statistics
import time

import torch

from minillm.distributed import pipeline
from minillm.distributed.pipeline import (
    bubble_fraction,
    bubble_parts,
    measured_bubble,
    uneven_bubble_fraction,
)
from minillm.llm import LLM
from minillm.sampling_params import SamplingParams

# the prompts and length of the chapter's two-stage runs
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def push(self, x):",
    "for i in range(10):",
]
MAX_TOKENS = 24
MODES = {
    "drained": {"pipeline_micro_batches": 2},
    "in_flight": {"pipeline_batches_in_flight": 2},
    "in_flight_3": {"pipeline_batches_in_flight": 3},
}
# recorded by main() (the chapter reads the uneven split from it)
RESULTS = (
    pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "pipeline_cpu.json"
)
LAYER_MS = 7.0  # the device stand-in's wait per layer: 21 ms for a stage of 3 layers
PARTS = ("fill_and_drain", "within_steps", "between_steps")  # pipeline.bubble_parts


def _run(llm: LLM, params: SamplingParams) -> dict:
    """One timed generate(): tokens, time, and the stages' timings of its steps."""
    engine = llm.engine
    engine.clear_parallel_stats()
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stages = [[r.timing for r in records if r.timing] for records in engine.pipeline_stats()]
    steps = list(zip(*stages, strict=True))
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "seconds": seconds,
        "bubble": engine.pipeline_bubble(),
        "parts": bubble_parts(stages),
        "steps": len(steps),
        "micro_batches": sum(t.num_micro_batches for t in stages[0]),
        "median_step_bubble": statistics.median(measured_bubble(list(s)) for s in steps),
        "busy_s_per_stage": [sum(t.busy_s for t in stage) for stage in stages],
        "host_s_per_stage": [sum(t.host_s for t in stage) for stage in stages],
    }


@contextlib.contextmanager
def device_stand_in(layer_seconds: float | None):
    """Every stage's forward over a micro-batch also waits layer_seconds per layer it holds
    (None: nothing changes). Worker processes forked inside the block inherit it."""
    if layer_seconds is None:
        yield
        return
    forward = pipeline.stage_forward

    def waiting_forward(model, *args):
        x = forward(model, *args)
        time.sleep(layer_seconds * len(model.model.layers))
        return x

    pipeline.stage_forward = waiting_forward
    try:
        yield
    finally:
        pipeline.stage_forward = forward


def measure_bubble(
    repeats: int = 5,
    max_tokens: int = MAX_TOKENS,
    layer_seconds: float | None = None,
    partition: tuple[int, ...] | None = None,
) -> dict:
    """The three engines, `repeats` interleaved runs each: per mode the runs' bubbles, their
    median and range, both formulas, and whether the tokens equal one process's.
    `partition`: the layers per stage (`pipeline_layer_partition`; None: equal shares)."""
    with device_stand_in(layer_seconds):
        measured = _measure(repeats, max_tokens, partition)
    return measured | {"layer_seconds": layer_seconds, "partition": partition}


def _measure(repeats: int, max_tokens: int, partition: tuple[int, ...] | None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(dtype="float32") as one:
        outputs = one.generate(PROMPTS, params, use_tqdm=False)
        reference = [list(o.outputs[0].token_ids) for o in outputs]
    engines = {
        mode: LLM(
            dtype="float32",
            pipeline_parallel_size=2,
            pipeline_layer_partition=partition,
            **options,
        )
        for mode, options in MODES.items()
    }
    try:
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for llm in engines.values():
            llm.generate(PROMPTS, params, use_tqdm=False)  # warm-up
        order = list(MODES)
        for repeat in range(repeats):
            for mode in order if repeat % 2 == 0 else order[::-1]:
                runs[mode].append(_run(engines[mode], params))
    finally:
        for llm in engines.values():
            llm.shutdown()
    result = {"stages": 2, "repeats": repeats, "requests": len(PROMPTS), "max_tokens": max_tokens}
    for mode, mode_runs in runs.items():
        bubbles = [run["bubble"] for run in mode_runs]
        batches = mode_runs[0]["micro_batches"]
        items = 2 if mode == "drained" else batches  # what fills and drains the pipeline
        # each run's stages, busy per micro-batch (or batch), in the formula for unequal ones
        stage_seconds = [[busy / batches for busy in r["busy_s_per_stage"]] for r in mode_runs]
        uneven = [uneven_bubble_fraction(t, items) for t in stage_seconds]
        result[mode] = {
            "options": MODES[mode],
            "formula": bubble_fraction(2, items),
            "formula_reads": "(p-1)/(m+p-1), m=2 per step"
            if mode == "drained"
            else f"(p-1)/(n+p-1), n={batches} batches in the run",
            # the stages as measured: 1 - n sum(t) / (p (sum(t) + (n-1) max(t))), per run
            "formula_uneven_median": statistics.median(uneven),
            "formula_uneven": uneven,
            "stage_seconds_per_batch_median": [
                statistics.median(t[s] for t in stage_seconds) for s in range(2)
            ],
            "bubble_median": statistics.median(bubbles),
            "bubble_min": min(bubbles),
            "bubble_max": max(bubbles),
            "bubbles": bubbles,
            # the bubble's parts (median of each over the runs): what the formula counts is
            # the fill and drain of a run in flight, the waits within the steps drained
            "parts_median": {
                part: statistics.median(r["parts"][part] for r in mode_runs) for part in PARTS
            },
            "median_step_bubble": statistics.median(r["median_step_bubble"] for r in mode_runs),
            "steps": mode_runs[0]["steps"],
            "micro_batches": batches,
            "seconds_median": statistics.median(r["seconds"] for r in mode_runs),
            "seconds": [r["seconds"] for r in mode_runs],
            "busy_s_per_stage_median": [
                statistics.median(r["busy_s_per_stage"][s] for r in mode_runs) for s in range(2)
            ],
            # of the busy time per batch, the host work of taking the plan and answering
            "host_ms_per_batch_median": [
                1e3 * statistics.median(r["host_s_per_stage"][s] for r in mode_runs) / batches
                for s in range(2)
            ],
            "tokens_equal_one_process": all(r["tokens"] == reference for r in mode_runs),
        }
    return result


def within(r: dict, key: str, tolerance: float = 0.2) -> bool:
    """Whether one mode's measured bubble is within `tolerance` (relative) of r[key], one of
    its formulas ("formula": equal stages, "formula_uneven_median": the stages as measured)."""
    return abs(r["bubble_median"] - r[key]) <= tolerance * r[key]


def verdict(r: dict, tolerance: float = 0.2) -> str:
    """One mode's measured bubble against both formulas, and whether it is within
    `tolerance` (relative) of each."""
    parts = [
        f"{r[key]:.3f} for {what} ({'within' if within(r, key, tolerance) else 'not within'} "
        f"{100 * tolerance:.0f}%)"
        for key, what in (
            ("formula", "equal stages"),
            ("formula_uneven_median", "the stages as measured"),
        )
    ]
    return f"bubble {r['bubble_median']:.3f} against " + " and ".join(parts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--layer-ms",
        type=float,
        default=LAYER_MS,
        help="the device stand-in's wait per layer of a stage's forward",
    )
    parser.add_argument("--partition", help='layers per stage, as "4,2" (default: equal shares)')
    parser.add_argument(
        "--uneven-partition",
        default="4,2",
        help="a split also measured with the stand-in, against its formula ('' for none)",
    )
    parser.add_argument("--note", default="", help="said in the JSON's note (the machine's load)")
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    args = parser.parse_args(argv)
    partition = None if args.partition is None else tuple(map(int, args.partition.split(",")))
    uneven = tuple(map(int, args.uneven_partition.split(","))) if args.uneven_partition else None
    load_before = os.getloadavg()
    measured = {
        "compute": measure_bubble(args.repeats, partition=partition),
        "device_stand_in": measure_bubble(
            args.repeats, layer_seconds=args.layer_ms / 1e3, partition=partition
        ),
    }
    if uneven is not None:
        measured["device_stand_in_uneven"] = measure_bubble(
            args.repeats, layer_seconds=args.layer_ms / 1e3, partition=uneven
        )
    verdicts = "; ".join(
        f"{kind} (split {measured[kind]['partition'] or 'equal'}), in_flight_3: "
        + verdict(measured[kind]["in_flight_3"])
        for kind in measured
        if kind != "compute"
    )
    met = [
        str(measured[kind]["partition"] or "equal")
        for kind in measured
        if kind != "compute" and within(measured[kind]["in_flight_3"], "formula")
    ]
    load_after = os.getloadavg()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "note": "times and the compute bubbles swing with the machine's load (load average "
        "above, over its cpu_count cores); the device stand-in's bubbles much less. "
        + f"Load average over the last minute: {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after. "
        + (args.note + " " if args.note else "")
        + verdicts
        + ". Three batches in flight with the stand-in meet the equal-stage formula (within "
        + f"20%) with the split: {', '.join(met) if met else 'none measured'}.",
        **measured,
    }
    for kind, mode in ((kind, mode) for kind in measured for mode in MODES):
        r = result[kind][mode]
        print(
            f"{kind}, {mode}: bubble {r['bubble_median']:.3f} ({r['bubble_min']:.3f}-"
            f"{r['bubble_max']:.3f}) against {r['formula']:.3f} {r['formula_reads']}, "
            f"{r['formula_uneven_median']:.3f} for the stages as measured "
            f"({', '.join(f'{1e3 * t:.1f}' for t in r['stage_seconds_per_batch_median'])} "
            f"ms per batch, of which host work "
            f"{', '.join(f'{t:.2f}' for t in r['host_ms_per_batch_median'])}); "
            f"{r['seconds_median']:.2f} s; tokens equal one process: "
            f"{r['tokens_equal_one_process']}"
        )
        print("    parts: " + ", ".join(f"{k} {v:.3f}" for k, v in r["parts_median"].items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
