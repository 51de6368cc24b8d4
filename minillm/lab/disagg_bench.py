"""TTFT and ITL of a colocated engine against a prefill/decode-disaggregated one, under a
small mixed load: short requests decoding while long prompts keep arriving.

`run_mixed_load(llm)` drives an engine step by step: `num_decoders` short prompts start at
once, and one long prompt joins every `arrival_every` steps. In a colocated engine a long
prompt's prefill shares the step with the decoders, so their inter-token latency (ITL) grows
in those steps; with disaggregation the prefill runs on its own process and the decoders'
steps only wait for the slower of the two ranks plus the KV transfer. Whether that pays
depends on the machine: two processes on two busy CPU cores compete for the same cores, and
each KV transfer is a copy. The numbers are measured, never assumed:
`compare_colocated_disaggregated` runs both engines on the same load, interleaved, and
returns both summaries (no thresholds anywhere); `python -m minillm.lab.disagg_bench --json
benchmarks/results/disagg_cpu.json` prints them side by side with their ratio.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics

from minillm import LLM, SamplingParams
from minillm.distributed.parallel_state import ranks_device


@dataclasses.dataclass(frozen=True, slots=True)
class LatencySummary:
    """Median and largest TTFT and ITL (seconds) of the requests of one run."""

    num_requests: int
    num_itl: int  # inter-token gaps measured
    ttft_median_s: float
    ttft_max_s: float
    itl_median_s: float
    itl_max_s: float
    kv_transfer_bytes: int  # 0 for a colocated engine
    kv_transfer_s: float


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
) -> LatencySummary:
    """Drive `llm`'s engine through the mixed load; TTFT and ITL from its request metrics."""
    engine = llm.engine
    short, long = mixed_load_prompts(num_decoders, num_long, long_len, engine.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(short):
        engine.add_request(f"short-{i}", prompt, params)
    metrics, step, pending = {}, 0, list(enumerate(long))
    while pending or engine.has_unfinished_requests():
        if pending and step % arrival_every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"long-{i}", prompt, params)
        for output in engine.step():
            if output.finished:
                metrics[output.request_id] = output.metrics
        step += 1
    ttft = [m.ttft_s for m in metrics.values()]
    itl = [gap for m in metrics.values() for gap in m.itl_s]
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
    )


def compare_colocated_disaggregated(
    model: str = "minillm-stdlib-target", dtype: str = "float32", rounds: int = 1, **load
) -> dict[str, list[LatencySummary]]:
    """The same mixed load on a colocated engine and on a disaggregated one, `rounds` times,
    interleaved (colocated, disaggregated, colocated, ...) so that both see the same machine;
    prefix caching is off in both, so that both compute every prompt. Both run on two GPUs
    when there are two, else on the CPU (`ranks_device(2)` says which, and why)."""
    device, _ = ranks_device(2)
    options = dict(
        dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=64, device=device
    )
    colocated_llm = LLM(model, **options)
    disaggregated_llm = LLM(
        model, kv_transfer_config={"kv_connector": "TorchDistributedConnector"}, **options
    )
    results: dict[str, list[LatencySummary]] = {"colocated": [], "disaggregated": []}
    try:
        for _ in range(rounds):
            results["colocated"].append(run_mixed_load(colocated_llm, **load))
            disaggregated_llm.engine.clear_parallel_stats()  # this round's transfers only
            results["disaggregated"].append(run_mixed_load(disaggregated_llm, **load))
    finally:
        disaggregated_llm.shutdown()
    return results


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import os
    import platform
    import time

    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
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
    results = compare_colocated_disaggregated(rounds=args.rounds)
    print("round  TTFT median ms (co / dis)   ITL median ms (co / dis)   ITL dis/co")
    for i, (co, dis) in enumerate(zip(*results.values(), strict=True)):
        print(
            f"{i:5d}  {co.ttft_median_s * 1e3:8.1f} / {dis.ttft_median_s * 1e3:8.1f}"
            f"      {co.itl_median_s * 1e3:8.1f} / {dis.itl_median_s * 1e3:8.1f}"
            f"      {dis.itl_median_s / co.itl_median_s:6.2f}"
        )
    if args.json:
        record = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "colocated_torch_threads": args.threads,
            "results": {
                mode: [dataclasses.asdict(summary) for summary in summaries]
                for mode, summaries in results.items()
            },
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
