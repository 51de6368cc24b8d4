"""What overlap scheduling hides: a step's parts, and the step time with and without overlap.

`EngineArgs(async_scheduling=True)` runs step n's forward in a worker thread while the
engine thread plans step n + 1 (with placeholders for step n's tokens) and then processes
step n's tokens (requests updated, text, stop strings, outputs) during step n + 1's forward
(`LLMEngine._step_async`). Two measurements, on the same model and the same requests:

- `step_breakdown`: the engine without overlap, every part of its step timed in place
  (planning, the forward with sampling, updating the requests, detokenization and stop
  strings, building the outputs, the rest). Everything but the forward runs in the engine
  thread while a forward runs, so a step can shrink from `cpu + forward` to
  `max(cpu, forward)`: `step / max(cpu, forward)` bounds what overlap gains on this workload.
- `overlap_bench`: whole runs with `async_scheduling` off and on, interleaved (the order
  alternates every repeat, after one warm-up run each), each run timed end to end; medians,
  spreads and the ratio of the medians. It also checks that both give the same outputs, and
  counts the steps the engine with overlap planned ahead (the others fell back).

Speed is measured, never asserted. On a CPU the forward itself runs Python (module calls,
the attention backend) as well as torch ops, and the two threads take turns at the GIL, so
less is hidden than the bound says; on a GPU the forward is mostly waiting for the device.

    python -m minillm.lab.overlap_bench --json benchmarks/results/overlap_cpu.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams

PARTS = ("schedule", "forward", "update", "detokenize", "make_outputs")
# a stop string the stdlib model never writes: its search costs what a real one costs
NEVER_STOP = "\x00<never>"


@dataclass(slots=True)
class Workload:
    """Text prompts, each asking for max_tokens tokens (EOS ignored), with stop strings."""

    prompts: list[str]
    max_tokens: int
    stop: list[str] = field(default_factory=lambda: [NEVER_STOP])

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, stop=list(self.stop)
        )


def default_workload(num_requests: int = 16, max_tokens: int = 48) -> Workload:
    """num_requests prompts of Python source lines (what the stdlib models were trained on)."""
    lines = [
        "def main(argv=None):",
        "import os\nimport sys\n",
        "class Parser(object):\n    def __init__(self, text):",
        "for key, value in sorted(items.items()):",
        "    return self._cache[name]",
        "if __name__ == '__main__':",
        "try:\n    import json\nexcept ImportError:",
        "with open(path, encoding='utf-8') as f:",
    ]
    return Workload([lines[i % len(lines)] + f"  # {i}" for i in range(num_requests)], max_tokens)


@dataclass(slots=True)
class StepBreakdown:
    """Seconds per step of each part of the engine's step, without overlap (medians of runs)."""

    num_steps: int
    step_s: float  # a whole step
    parts_s: dict[str, float]  # each of PARTS; "other" is the rest of the step

    @property
    def cpu_s(self) -> float:
        """All of a step but the forward: planning and output processing, which overlap
        scheduling runs in the engine thread while a forward runs."""
        return self.step_s - self.parts_s["forward"]

    @property
    def hideable_fraction(self) -> float:
        """The share of a step overlap can hide: the CPU part, up to the forward's length."""
        return min(self.cpu_s, self.parts_s["forward"]) / self.step_s

    @property
    def bound_speedup(self) -> float:
        return 1.0 / (1.0 - self.hideable_fraction)


def _run(engine: LLMEngine, workload: Workload, tag: str) -> tuple[float, int, dict[str, tuple]]:
    """Add every prompt at once and step until done: (seconds, steps, outputs by prompt)."""
    params = workload.params()
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    outputs: dict[str, tuple] = {}
    num_steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                c = output.outputs[0]
                outputs[output.request_id.split("-", 1)[1]] = (tuple(c.token_ids), c.text)
        num_steps += 1
    return time.perf_counter() - start, num_steps, outputs


def _timed(method, totals: dict[str, float], name: str):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return timed


def step_breakdown(engine_args: EngineArgs, workload: Workload, repeats: int = 3) -> StepBreakdown:
    """Time every part of the step of an engine without overlap, in place (the engine's own
    methods wrapped with a timer on this one engine); medians over `repeats` runs after a
    warm-up run."""
    if engine_args.async_scheduling:
        raise ValueError("step_breakdown times the engine without overlap: async_scheduling=False")
    engine = LLMEngine(engine_args)
    totals: dict[str, float] = defaultdict(float)
    engine.scheduler.schedule = _timed(engine.scheduler.schedule, totals, "schedule")
    engine.runner.execute_model = _timed(engine.runner.execute_model, totals, "forward")
    engine.scheduler.update_from_output = _timed(
        engine.scheduler.update_from_output, totals, "update"
    )
    processor = engine.output_processor
    processor.detokenize = _timed(processor.detokenize, totals, "detokenize")
    processor.make_outputs = _timed(processor.make_outputs, totals, "make_outputs")
    _run(engine, workload, "warmup")
    per_run: list[tuple[float, int, dict[str, float]]] = []
    for r in range(repeats):
        totals.clear()
        elapsed, num_steps, _ = _run(engine, workload, f"r{r}")
        per_run.append((elapsed, num_steps, dict(totals)))
    num_steps = per_run[0][1]
    step_s = statistics.median(e / n for e, n, _ in per_run)
    parts = {name: statistics.median(t.get(name, 0.0) / n for _, n, t in per_run) for name in PARTS}
    parts["other"] = max(0.0, step_s - sum(parts.values()))
    return StepBreakdown(num_steps, step_s, parts)


@dataclass(slots=True)
class OverlapResult:
    """Whole runs without and with async scheduling, interleaved."""

    sync_s: list[float]  # seconds per run, in run order
    async_s: list[float]
    sync_steps: int
    async_steps: int
    outputs_equal: bool  # every request's tokens and text the same in both modes
    planned_ahead_steps: int = 0  # steps of one async run planned while a forward ran

    @property
    def speedup(self) -> float:
        """Median run time without overlap over the median with it (> 1: overlap is faster)."""
        return statistics.median(self.sync_s) / statistics.median(self.async_s)

    def summary(self) -> dict:
        def stats(runs: list[float], steps: int) -> dict:
            return {
                "median_s": statistics.median(runs),
                "min_s": min(runs),
                "max_s": max(runs),
                "median_ms_per_step": 1e3 * statistics.median(runs) / steps,
                "steps": steps,
                "runs_s": runs,
            }

        return {
            "sync": stats(self.sync_s, self.sync_steps),
            "async": stats(self.async_s, self.async_steps),
            "speedup_sync_over_async": self.speedup,
            "outputs_equal": self.outputs_equal,
            "planned_ahead_steps": self.planned_ahead_steps,
        }


def overlap_bench(engine_args: EngineArgs, workload: Workload, repeats: int = 5) -> OverlapResult:
    """Run the workload `repeats` times on an engine without and one with async_scheduling,
    alternating which goes first, after a warm-up run on each."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    engines = {
        mode: LLMEngine(_with_async(engine_args, mode == "async")) for mode in ("sync", "async")
    }
    scheduler = engines["async"].scheduler
    num_ahead = [0]

    def counted_schedule_ahead(in_flight):
        plan = schedule_ahead(in_flight)
        num_ahead[0] += plan is not None
        return plan

    schedule_ahead, scheduler.schedule_ahead = scheduler.schedule_ahead, counted_schedule_ahead
    outputs = {mode: _run(engine, workload, "warmup")[2] for mode, engine in engines.items()}
    planned_ahead_steps = num_ahead[0]
    times: dict[str, list[float]] = {"sync": [], "async": []}
    steps: dict[str, int] = {}
    for r in range(repeats):
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        for mode in order:
            elapsed, num_steps, out = _run(engines[mode], workload, f"r{r}")
            times[mode].append(elapsed)
            steps[mode] = num_steps
            if out != outputs[mode]:
                raise RuntimeError(f"the {mode} engine gave different outputs in repeat {r}")
    engines["async"].shutdown()
    return OverlapResult(
        times["sync"],
        times["async"],
        steps["sync"],
        steps["async"],
        outputs["sync"] == outputs["async"],
        planned_ahead_steps,
    )


def _with_async(engine_args: EngineArgs, on: bool) -> EngineArgs:
    fields = {name: getattr(engine_args, name) for name in engine_args.__dataclass_fields__}
    return EngineArgs(**{**fields, "async_scheduling": on})


def record(engine_args: EngineArgs, workload: Workload, repeats: int = 5) -> dict:
    """Both measurements with where and when they ran, as recorded in benchmarks/results."""
    from minillm.lab.bench import machine_record

    breakdown = step_breakdown(engine_args, workload, repeats=max(1, repeats // 2))
    result = overlap_bench(engine_args, workload, repeats)
    return {
        **machine_record(),
        "model": str(engine_args.model),
        "num_requests": len(workload.prompts),
        "max_tokens": workload.max_tokens,
        "stop": workload.stop,
        "repeats": repeats,
        "breakdown_ms_per_step": {
            "step": 1e3 * breakdown.step_s,
            **{name: 1e3 * s for name, s in breakdown.parts_s.items()},
        },
        # what overlap scheduling runs beside the forward: all of the step but the forward
        "cpu_ms_per_step": 1e3 * breakdown.cpu_s,
        "forward_ms_per_step": 1e3 * breakdown.parts_s["forward"],
        "hideable_fraction": breakdown.hideable_fraction,
        "bound_speedup": breakdown.bound_speedup,
        **result.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minillm-stdlib-target")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    engine_args = EngineArgs(model=args.model, device="cpu", max_model_len=256)
    rec = record(engine_args, default_workload(args.num_requests, args.max_tokens), args.repeats)
    b = rec["breakdown_ms_per_step"]
    print("ms per step without overlap: " + ", ".join(f"{k} {v:.3f}" for k, v in b.items()))
    print(
        f"planning and output processing {rec['cpu_ms_per_step']:.3f} ms beside a forward of "
        f"{rec['forward_ms_per_step']:.3f} ms: overlap can hide {rec['hideable_fraction']:.1%} "
        f"(bound {rec['bound_speedup']:.3f}x)"
    )
    for mode in ("sync", "async"):
        s = rec[mode]
        print(
            f"{mode:5s}: median {s['median_s']:.3f} s ({s['min_s']:.3f}-{s['max_s']:.3f}), "
            f"{s['steps']} steps, {s['median_ms_per_step']:.3f} ms/step"
        )
    print(
        f"async_scheduling speed-up {rec['speedup_sync_over_async']:.3f}x, "
        f"outputs equal: {rec['outputs_equal']}, "
        f"{rec['planned_ahead_steps']} of {rec['async']['steps']} steps planned ahead"
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rec, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
