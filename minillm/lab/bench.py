"""`minillm bench offline`, `bench scheduler` and `bench serve`: speed measured, never asserted.

`bench serve` (a load generator for OpenAI-compatible servers) is in `minillm.lab.loadgen`.

`bench offline`: continuous batching against its two baselines, in one run.

The same model and the same requests go through three systems on the same machine:

- minillm with continuous batching (every request queued at once);
- minillm one request at a time (the same engine, each prompt alone);
- `transformers` `generate` with static batches: requests are grouped in arrival order, and
  each group runs until its longest output is done, with padding for shorter prompts.

Each request asks for a fixed number of output tokens (EOS ignored), so the three systems do
the same useful work: throughput counts only the requested tokens, never the padding or the
steps a static batch keeps running for its longest member. Speed is measured, not asserted:
the command prints tokens/s for each system and the ratios between them. The two batched
systems run `--repeats` rounds, interleaved (A B, then B A, ...), and the table shows the
median and the range; one-at-a-time runs once.

Beside the ratios it prints where the time of a continuous-batching step goes (attention,
linear layers, the rest of the model, outside the model), the Python overhead of a full
decode step, and the FLOP/s achieved against the fp32 GEMM peak measured in the same run
(`minillm.lab.step_breakdown`): the MFU of the run. That breakdown comes from one more run
with every part timed, so its wrappers (about a microsecond per call) never touch the
timed rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(slots=True)
class Workload:
    """Prompts (token ids) and the number of output tokens each one asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(slots=True)
class BenchResult:
    system: str
    elapsed_s: float
    num_requests: int
    num_output_tokens: int
    num_prompt_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_output_tokens + self.num_prompt_tokens) / self.elapsed_s


def make_workload(
    num_requests: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    vocab_size: int,
    special_ids: set[int],
    seed: int,
) -> Workload:
    """Random prompt and output lengths (uniform, inclusive) and random ordinary token ids."""
    rng = np.random.default_rng(seed)
    ordinary = np.array([t for t in range(vocab_size) if t not in special_ids])
    input_lens = rng.integers(input_len_range[0], input_len_range[1] + 1, num_requests)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, num_requests)
    prompts = [rng.choice(ordinary, size=int(n)).tolist() for n in input_lens]
    return Workload(prompts, [int(n) for n in output_lens])


def run_minillm(llm, workload: Workload, one_at_a_time: bool) -> BenchResult:
    from minillm.sampling_params import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [
            llm.generate([prompt], p, use_tqdm=False)[0]
            for prompt, p in zip(workload.prompts, params, strict=True)
        ]
    else:
        outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if produced != workload.output_lens:
        raise RuntimeError("minillm produced a different number of tokens than requested")
    system = "minillm, one request at a time" if one_at_a_time else "minillm, continuous batching"
    return BenchResult(system, elapsed_s, len(outputs), sum(produced), workload.num_prompt_tokens)


def run_transformers(model, pad_id: int, workload: Workload, batch_size: int) -> BenchResult:
    """Static batching: left-padded groups in arrival order, each run to its longest output."""
    import torch

    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        max_new = max(workload.output_lens[first : first + batch_size])
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=pad_id,
            )
        if out.shape[1] != width + max_new:
            raise RuntimeError("transformers stopped before max_new_tokens")
    elapsed_s = time.perf_counter() - start
    return BenchResult(
        f"transformers generate, static batches of {batch_size}",
        elapsed_s,
        len(workload.prompts),
        workload.num_output_tokens,
        workload.num_prompt_tokens,
    )


def bench_offline(args: argparse.Namespace) -> dict:
    """Run the three systems on one workload; returns a JSON-ready record of the run."""
    import torch

    from minillm.llm import LLM
    from minillm.model.loader import DEFAULT_MODEL, resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model or DEFAULT_MODEL)
    llm = LLM(
        str(model_path),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        device="cpu",
        enforce_eager=args.enforce_eager,
    )
    tokenizer = llm.get_tokenizer()
    config = llm.engine.config
    specials = {
        t
        for t in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        if t is not None
    }
    workload = make_workload(
        args.num_requests,
        tuple(args.input_len),
        tuple(args.output_len),
        config.vocab_size,
        specials,
        args.seed,
    )
    warmup = Workload(workload.prompts[:2], [4, 4])
    run_minillm(llm, warmup, one_at_a_time=False)
    hf_model = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, args.dtype)
        )
        hf_model.eval()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        run_transformers(hf_model, pad_id, warmup, args.batch_size)
    # rounds interleaved (A B, B A, ...), so that load from other work hits both systems
    rounds: list[list[BenchResult]] = []
    for i in range(args.repeats):
        runs = [lambda: run_minillm(llm, workload, one_at_a_time=False)]
        if hf_model is not None:
            runs.append(lambda: run_transformers(hf_model, pad_id, workload, args.batch_size))
        order = list(range(len(runs))) if i % 2 == 0 else list(reversed(range(len(runs))))
        done = {j: runs[j]() for j in order}
        rounds.append([done[j] for j in range(len(runs))])
    results = [median_result([r[j] for r in rounds]) for j in range(len(rounds[0]))]
    if not args.skip_one_at_a_time:  # the slowest by far: once
        results.insert(1, run_minillm(llm, workload, one_at_a_time=True))
    steps = measure_breakdown(llm, workload, args.max_num_seqs)

    baseline = results[0].output_tokens_per_s
    print(
        f"{len(workload.prompts)} requests, {workload.num_prompt_tokens} prompt tokens, "
        f"{workload.num_output_tokens} output tokens; model {model_path.name}, "
        f"{args.dtype}, {torch.get_num_threads()} threads; median of {args.repeats} "
        "interleaved rounds"
    )
    header = f"{'system':<46} {'time (s)':>9} {'min-max (s)':>13} {'out tok/s':>10}"
    print(f"{header} {'CB / this':>10}")
    for r in results:
        times = [x.elapsed_s for row in rounds for x in row if x.system == r.system]
        spread = f"{min(times):.2f}-{max(times):.2f}" if times else "-"
        print(
            f"{r.system:<46} {r.elapsed_s:9.2f} {spread:>13} {r.output_tokens_per_s:10.1f} "
            f"{baseline / r.output_tokens_per_s:9.2f}x"
        )
    print_breakdown(steps)
    return {
        **machine_record(),
        "load_average": list(os.getloadavg()),
        "model": str(args.model or DEFAULT_MODEL),
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "workload": {
            "num_requests": len(workload.prompts),
            "input_len": list(args.input_len),
            "output_len": list(args.output_len),
            "seed": args.seed,
            "num_prompt_tokens": workload.num_prompt_tokens,
            "num_output_tokens": workload.num_output_tokens,
        },
        "repeats": args.repeats,
        "results": [
            {
                **asdict(r),
                "output_tokens_per_s": r.output_tokens_per_s,
                "total_tokens_per_s": r.total_tokens_per_s,
                "elapsed_s_rounds": [
                    x.elapsed_s for row in rounds for x in row if x.system == r.system
                ],
            }
            for r in results
        ],
        "speedup_vs": {r.system: baseline / r.output_tokens_per_s for r in results[1:]},
        # each round's own ratio: the spread of the speed-up under the machine's load
        "speedup_vs_rounds": {
            rounds[0][j].system: [row[j].elapsed_s / row[0].elapsed_s for row in rounds]
            for j in range(1, len(rounds[0]))
        },
        "breakdown": steps,
    }


def median_result(runs: list[BenchResult]) -> BenchResult:
    """The run of median time (the lower median for an even count)."""
    return sorted(runs, key=lambda r: r.elapsed_s)[(len(runs) - 1) // 2]


def measure_breakdown(llm, workload: Workload, max_num_seqs: int) -> dict:
    """One more continuous-batching run with every step timed by parts (`StepRecorder`), the
    fp32 GEMM peak measured now, and the Python overhead of a full decode step.

    The timed run's steps are eager: its timers wrap the layers in Python, which a traced
    decode step (`minillm.worker.decode_trace`) would skip, so the engine runs them
    untraced. The overhead share is measured on the engine as it runs, traced if it is."""
    from minillm.lab.step_breakdown import (
        StepRecorder,
        breakdown,
        measure_gemm_peak,
        python_overhead_share,
    )

    engine = llm.engine
    recorder = StepRecorder(engine).install()
    try:
        run_minillm(llm, workload, one_at_a_time=False)
    finally:
        recorder.uninstall()
    peak = measure_gemm_peak()
    batch = min(len(workload.prompts), max_num_seqs)
    overhead = python_overhead_share(engine, workload.prompts[:batch])
    full_decode = [s for s in recorder.steps if s.decode_only and s.num_seqs == batch]
    record = {
        "gemm_peak_flops_per_s": peak,
        "decode_batch": batch,
        "python_overhead_share": overhead,
        "decode_traced": engine.model_runner.decode_trace is not None,
    }
    for name, steps in (("all_steps", recorder.steps), ("full_decode_steps", full_decode)):
        b = breakdown(steps)
        record[name] = {
            "num_steps": b.num_steps,
            "step_s": b.step_s,
            "shares": b.shares,
            "flops": b.flops,
            "flops_per_s": b.flops_per_s,
            "mfu": b.flops_per_s / peak,
        }
    return record


def print_breakdown(record: dict) -> None:
    from minillm.lab.step_breakdown import PARTS

    peak = record["gemm_peak_flops_per_s"]
    print(
        f"\nwhere a step's time goes, eager steps (fp32 GEMM peak measured now: "
        f"{peak / 1e9:.1f} GFLOP/s)"
    )
    names = {
        "all_steps": "all steps",
        "full_decode_steps": f"decode, {record['decode_batch']} seqs",
    }
    print(
        f"{'steps':<20} {'n':>5} {'ms/step':>8} "
        + " ".join(f"{p:>17}" for p in PARTS)
        + f" {'GFLOP/s':>8} {'MFU':>6}"
    )
    for key, label in names.items():
        b = record[key]
        if not b["num_steps"]:
            continue
        shares = " ".join(f"{b['shares'][p]:17.1%}" for p in PARTS)
        print(
            f"{label:<20} {b['num_steps']:5d} {b['step_s'] / b['num_steps'] * 1e3:8.2f} {shares}"
            f" {b['flops_per_s'] / 1e9:8.1f} {b['mfu']:6.1%}"
        )
    traced = " (traced forward)" if record.get("decode_traced") else ""
    print(
        f"Python and dispatch (outside every aten op) in a decode step of "
        f"{record['decode_batch']} sequences{traced}: {record['python_overhead_share']:.1%}"
    )


def scheduler_step_s(num_seqs: int, prompt_len: int, output_len: int) -> tuple[float, int]:
    """Mean time of one scheduler step (schedule + update_from_output) with no model, as
    num_seqs requests decode together; returns (seconds per step, number of steps)."""
    from minillm.core.kv_cache_manager import KVCacheManager
    from minillm.core.request import Request
    from minillm.core.scheduler import Scheduler
    from minillm.outputs import SampledToken
    from minillm.sampling_params import SamplingParams

    block_size = 16
    num_blocks = num_seqs * -(-(prompt_len + output_len) // block_size) + 64
    manager = KVCacheManager(num_blocks, block_size)
    scheduler = Scheduler(
        manager,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(16384, num_seqs),
        max_model_len=prompt_len + output_len + 1,
    )
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [(i * 7 + j) % 30000 for j in range(prompt_len)]
        scheduler.add_request(Request(str(i), prompt, params, 0.0))
    token = SampledToken(5)
    num_steps = 0
    start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        sampled = {seq.request_id: token for s in plan.scheduled for seq in s.sampling_seqs}
        scheduler.update_from_output(plan, sampled)
        num_steps += 1
    return (time.perf_counter() - start) / num_steps, num_steps


def bench_scheduler(args: argparse.Namespace) -> dict:
    """Scheduler time per step for several batch sizes, repeats interleaved (round robin)."""
    times: dict[int, list[float]] = {n: [] for n in args.num_seqs}
    for _ in range(args.repeats):
        for n in args.num_seqs:
            step_s, num_steps = scheduler_step_s(n, args.prompt_len, args.output_len)
            times[n].append(step_s)
    print(
        f"scheduler + KV-cache manager, no model: {args.prompt_len}-token prompts, "
        f"{args.output_len} output tokens, {args.repeats} repeats interleaved"
    )
    print(f"{'sequences':>10} {'median ms/step':>15} {'min-max ms':>16} {'us/seq/step':>12}")
    rows = []
    for n, samples in times.items():
        median = float(np.median(samples))
        print(
            f"{n:>10} {median * 1e3:15.3f} {min(samples) * 1e3:7.3f}-{max(samples) * 1e3:<8.3f}"
            f" {median / n * 1e6:12.2f}"
        )
        rows.append({"num_seqs": n, "step_s": samples, "median_step_s": median})
    smallest, largest = rows[0], rows[-1]
    ratio = (largest["median_step_s"] / largest["num_seqs"]) / (
        smallest["median_step_s"] / smallest["num_seqs"]
    )
    print(
        f"cost per sequence at {largest['num_seqs']} / at {smallest['num_seqs']}: {ratio:.2f}x "
        "(1.0 is linear bookkeeping)"
    )
    return {
        **machine_record(),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "results": rows,
        "per_sequence_cost_ratio": ratio,
    }


def machine_record() -> dict:
    """Where and when a benchmark ran: date, CPU, cores, torch threads, torch and Python."""
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (speed is measured, never asserted)")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    offline = kinds.add_parser(
        "offline", help="continuous batching vs one at a time vs transformers static batches"
    )
    offline.add_argument(
        "--model", default=None, help="HF directory or bundled name (default: bundled)"
    )
    offline.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    offline.add_argument("--num-requests", type=int, default=64)
    offline.add_argument(
        "--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX")
    )
    offline.add_argument(
        "--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX")
    )
    offline.add_argument("--max-num-seqs", type=int, default=64)
    offline.add_argument(
        "--batch-size", type=int, default=16, help="static batch size for transformers"
    )
    offline.add_argument("--seed", type=int, default=0)
    offline.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: torch's default)"
    )
    offline.add_argument(
        "--enforce-eager", action="store_true", help="no traced decode forward (for A/B runs)"
    )
    offline.add_argument("--skip-transformers", action="store_true")
    offline.add_argument("--skip-one-at-a-time", action="store_true")
    offline.add_argument(
        "--repeats", type=int, default=3, help="interleaved rounds of the batched systems"
    )
    offline.add_argument("--json", default=None, help="write the results to this JSON file")
    offline.set_defaults(func=_run_offline)
    scheduler = kinds.add_parser(
        "scheduler", help="scheduler time per step, no model, at several batch sizes"
    )
    scheduler.add_argument("--num-seqs", type=int, nargs="+", default=[32, 128, 256, 1024])
    scheduler.add_argument("--prompt-len", type=int, default=32)
    scheduler.add_argument("--output-len", type=int, default=256)
    scheduler.add_argument("--repeats", type=int, default=3)
    scheduler.add_argument("--json", default=None, help="write the results to this JSON file")
    scheduler.set_defaults(func=_run_scheduler)
    from minillm.lab import loadgen

    loadgen.add_parser(kinds)


def _run_offline(args: argparse.Namespace) -> int:
    record = bench_offline(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0


def _run_scheduler(args: argparse.Namespace) -> int:
    record = bench_scheduler(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0
