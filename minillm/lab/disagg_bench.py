"""TTFT and ITL of a colocated engine against a prefill/decode-disaggregated one, under a
small mixed load: short requests decoding while long prompts keep arriving, and the same short
requests alone.

`run_mixed_load(llm)` drives an engine step by step: `num_decoders` short prompts start at
once, and once they all decode one long prompt joins every `arrival_every` steps (none with
`num_long=0`). In a
colocated engine a long prompt's prefill chunks share steps with the decoders, so their
inter-token gaps grow in those steps. With disaggregation the prefill runs on its own process
and the decode process never waits for it (`minillm.distributed.disaggregation`): the
decoders' worst gap should be about what it is without the long prompts, on any machine where
the two processes do not starve each other of cores. The numbers are measured, never assumed:
`decode_gap_rounds` runs both engines with and without the long prompts, in interleaved
rounds (the order reversed every other round), and returns every summary (no thresholds
anywhere); `python -m minillm.lab.disagg_bench --json benchmarks/results/disagg_cpu.json`
prints the decoders' worst gaps side by side and records them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics

from minillm import LLM, SamplingParams
from minillm.distributed.parallel_state import ranks_device

# where `python -m minillm.lab.disagg_bench --json` records by default, and the page reads
RESULTS_FILE = pathlib.Path(__file__).resolve().parents[2] / "benchmarks/results/disagg_cpu.json"


@dataclasses.dataclass(frozen=True, slots=True)
class LatencySummary:
    """Median and largest TTFT and ITL (seconds) of the requests of one run; the short
    requests' (decoders') ITL apart; the long prompts' longest prefill (first scheduled to
    first token)."""

    num_requests: int
    num_itl: int  # inter-token gaps measured
    ttft_median_s: float
    ttft_max_s: float
    itl_median_s: float
    itl_max_s: float
    kv_transfer_bytes: int  # 0 for a colocated engine
    kv_transfer_s: float
    decode_itl_median_s: float
    decode_itl_max_s: float
    long_prefill_max_s: float  # 0 without long prompts


def mixed_load_prompts(
    num_decoders: int, num_long: int, long_len: int, vocab_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Token-id prompts: short ones (4 tokens) and long ones (long_len tokens), deterministic."""
    short = [[(7 * i + j) % (vocab_size - 3) + 3 for j in range(4)] for i in range(num_decoders)]
    long = [
        [(13 * i + 5 * j) % (vocab_size - 3) + 3 for j in range(long_len)] for i in range(num_long)
    ]
    return short, long


def run_mixed_load(
    llm: LLM,
    num_decoders: int = 3,
    num_long: int = 3,
    long_len: int = 48,
    max_tokens: int = 12,
    arrival_every: int = 3,
    long_max_tokens: int | None = None,
) -> LatencySummary:
    """Drive `llm`'s engine through the mixed load; TTFT and ITL from its request metrics.
    The long prompts generate `long_max_tokens` tokens (default: max_tokens, as the short
    ones); with 1 they never join the decode batch, which then stays the same with and
    without them, so that only their prefills differ."""
    engine = llm.engine
    short, long = mixed_load_prompts(num_decoders, num_long, long_len, engine.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    long_params = SamplingParams(
        temperature=0, max_tokens=long_max_tokens or max_tokens, ignore_eos=True
    )
    for i, prompt in enumerate(short):
        engine.add_request(f"short-{i}", prompt, params)
    # the long prompts join once every decoder has its first token, one every arrival_every
    # steps from then on
    metrics, started, step, pending = {}, set(), 0, list(enumerate(long))
    while pending or engine.has_unfinished_requests():
        if pending and len(started) >= num_decoders:  # started: short ids only
            if step % arrival_every == 0:
                i, prompt = pending.pop(0)
                engine.add_request(f"long-{i}", prompt, long_params)
            step += 1
        for output in engine.step():
            if output.request_id.startswith("short"):
                started.add(output.request_id)
            if output.finished:
                metrics[output.request_id] = output.metrics
    ttft = [m.ttft_s for m in metrics.values()]
    itl = [gap for m in metrics.values() for gap in m.itl_s]
    decode_itl = [gap for rid, m in metrics.items() if rid.startswith("short") for gap in m.itl_s]
    prefill = [
        m.token_times[0] - m.first_scheduled_time
        for rid, m in metrics.items()
        if rid.startswith("long")
    ]
    transfers = [] if engine.executor is None else engine.executor.kv_transfer_records()
    return LatencySummary(
        num_requests=len(metrics),
        num_itl=len(itl),
        ttft_median_s=statistics.median(ttft),
        ttft_max_s=max(ttft),
        itl_median_s=statistics.median(itl),
        itl_max_s=max(itl),
        kv_transfer_bytes=sum(t.num_bytes for t in transfers),
        kv_transfer_s=sum(t.seconds for t in transfers),
        decode_itl_median_s=statistics.median(decode_itl),
        decode_itl_max_s=max(decode_itl),
        long_prefill_max_s=max(prefill, default=0.0),
    )


# the runs of one round: engine, and whether long prompts arrive
RUNS = (
    ("colocated", "alone"),
    ("colocated", "with prompts"),
    ("disaggregated", "alone"),
    ("disaggregated", "with prompts"),
)


def decode_gap_rounds(
    model: str = "minillm-stdlib-target",
    dtype: str = "float32",
    rounds: int = 3,
    num_long: int = 2,
    **load,
) -> dict[tuple[str, str], list[LatencySummary]]:
    """The mixed load on a colocated engine and on a disaggregated one, each with and without
    the long prompts, `rounds` times: every round runs the four, in RUNS order on even rounds
    and reversed on odd ones (ABBA), so that all four see the same machine. Prefix caching is
    off in both engines, so that both compute every prompt. Both run on two GPUs when there
    are two, else on the CPU (`ranks_device(2)` says which, and why)."""
    device, _ = ranks_device(2)
    options = dict(
        dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=64, device=device
    )
    engines = {"colocated": LLM(model, **options)}
    engines["disaggregated"] = LLM(
        model, kv_transfer_config={"kv_connector": "TorchDistributedConnector"}, **options
    )
    results: dict[tuple[str, str], list[LatencySummary]] = {run: [] for run in RUNS}
    try:
        for i in range(rounds):
            for mode, prompts in RUNS if i % 2 == 0 else RUNS[::-1]:
                llm = engines[mode]
                llm.engine.clear_parallel_stats()  # this run's transfers only
                arriving = num_long if prompts == "with prompts" else 0
                results[mode, prompts].append(run_mixed_load(llm, num_long=arriving, **load))
    finally:
        engines["disaggregated"].shutdown()
    return results


def gap_ratios(results: dict[tuple[str, str], list[LatencySummary]], mode: str) -> list[float]:
    """Per round, the decoders' worst gap with the long prompts over their worst gap alone."""
    return [
        with_.decode_itl_max_s / alone.decode_itl_max_s
        for with_, alone in zip(results[mode, "with prompts"], results[mode, "alone"], strict=True)
    ]


def median_worst_gaps(
    results: dict[tuple[str, str], list[LatencySummary]],
) -> dict[tuple[str, str], float]:
    """Per run (engine, with or without prompts), the median over rounds of the decoders'
    worst inter-token gap (seconds)."""
    return {
        run: statistics.median(s.decode_itl_max_s for s in summaries)
        for run, summaries in results.items()
    }


def read_results(path: pathlib.Path = RESULTS_FILE) -> tuple[dict, dict]:
    """A recorded run of `main`: the record (machine, load, versions) and its summaries by
    run, as `decode_gap_rounds` returns them."""
    record = json.loads(pathlib.Path(path).read_text())
    results = {
        tuple(key.split(", ")): [LatencySummary(**summary) for summary in summaries]
        for key, summaries in record["results"].items()
    }
    return record, results


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import os
    import platform
    import time

    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--json", type=pathlib.Path, help=f"write the results here ({RESULTS_FILE})"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 2),
        help="torch threads of the colocated engine; default: what each disaggregated rank gets",
    )
    args = parser.parse_args(argv)
    # many threads spinning on a loaded machine would slow the colocated engine for a reason
    # that has nothing to do with disaggregation: give it what each worker rank gets
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    load = dict(
        num_decoders=2,
        num_long=2,
        long_len=512,
        max_tokens=32,
        arrival_every=4,
        long_max_tokens=1,
    )
    results = decode_gap_rounds(rounds=args.rounds, **load)
    print("decoders' worst inter-token gap, ms (median gap in brackets); long prompts' prefill")
    for mode in ("colocated", "disaggregated"):
        for i, (alone, with_) in enumerate(
            zip(results[mode, "alone"], results[mode, "with prompts"], strict=True)
        ):
            print(
                f"{mode:13s} round {i}: alone {alone.decode_itl_max_s * 1e3:7.1f} "
                f"({alone.decode_itl_median_s * 1e3:5.1f}), with prompts "
                f"{with_.decode_itl_max_s * 1e3:7.1f} ({with_.decode_itl_median_s * 1e3:5.1f}),"
                f" ratio {with_.decode_itl_max_s / alone.decode_itl_max_s:5.2f}; prefill "
                f"{with_.long_prefill_max_s * 1e3:7.1f}"
            )
    if args.json:
        record = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_1m_before": load_before,
            "load_average_1m_after": os.getloadavg()[0],
            "torch": torch.__version__,
            "colocated_torch_threads": args.threads,
            "load": load,
            "results": {
                f"{mode}, {prompts}": [dataclasses.asdict(summary) for summary in summaries]
                for (mode, prompts), summaries in results.items()
            },
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
