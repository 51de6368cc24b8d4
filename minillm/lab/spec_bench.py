"""Speculative decoding measured: acceptance, tokens per target forward and speed-up.

    python -m minillm.lab.spec_bench [--json benchmarks/results/spec_decode_cpu.json]

Side by side in one run, interleaved (every repeat runs every system once, in turn): the
bundled target alone, the target with the bundled draft (k = 2 and k = 4), and the target with
n-gram drafting (k = 4), on two workloads: Python prompts in the models' own domain, and a
repetitive workload (code that repeats what is in the prompt) where prompt lookup shines. One
request at a time, greedy: speculative decoding is a latency tool. Per system: the median wall
time and its spread over the repeats, the speed-up against the target alone, the acceptance
rate per draft position, the mean accepted length (tokens per verification round) and the
tokens per verification predicted from the measured acceptance rate alpha,
(1 - alpha^(k+1)) / (1 - alpha), which assumes each draft is accepted independently with
probability alpha.

The model it checks is chapter 7's, in `minillm.lab.decoding`: `expected_accepted_length(alpha,
k)` and its inverse `alpha_from_tokens_per_round(tokens, k)`.
Measured tokens per round exceed the prediction at the measured alpha when acceptances are
correlated (a draft that got the first token right tends to get the next right too), which is
what the per-position rates show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from minillm.lab.decoding import alpha_from_tokens_per_round, expected_accepted_length
from minillm.lab.recorded import weights_record

# Python code from the models' domain (the standard library's style)
CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef main():\n    for path in",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "    def test_basic(self):\n        self.assertEqual(",
]
# a function written out, then begun again: the continuation copies what the prompt holds
_BODY = (
    "def read_config(path):\n"
    "    with open(path) as f:\n"
    "        lines = f.readlines()\n"
    "    result = {}\n"
    "    for line in lines:\n"
    "        key, value = line.split('=')\n"
    "        result[key.strip()] = value.strip()\n"
    "    return result\n\n\n"
)
REPETITIVE_PROMPTS = [
    _BODY + "def read_config(path):\n    with open(path) as f:\n",
    _BODY + _BODY.replace("read_config", "load_settings")[:60],
    "self.assertEqual(a, 1)\nself.assertEqual(b, 2)\nself.assertEqual(c, 3)\nself.assertEqual(",
    "x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
]


SYSTEMS = {
    "target alone": None,
    "draft model, k=2": {"model": "minillm-stdlib-draft", "num_speculative_tokens": 2},
    "draft model, k=4": {"model": "minillm-stdlib-draft", "num_speculative_tokens": 4},
    "n-gram, k=4": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    },
}


def run_workload(llm, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Each prompt alone, one after the other; returns the wall time and the outputs."""
    from minillm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return time.perf_counter() - start, outputs


def stats_record(stats, k: int) -> dict:
    alpha = stats.draft_acceptance_rate
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
        "acceptance_rate": alpha,
        "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "tokens_per_target_forward": stats.tokens_per_target_forward,
        "predicted_tokens_per_round": expected_accepted_length(alpha, k),
        # the alpha that independent drafts would need to give the measured tokens per round
        "alpha_fitted": alpha_from_tokens_per_round(stats.mean_acceptance_length, k)
        if stats.num_drafts
        else None,
    }


def bench(args: argparse.Namespace) -> dict:
    import torch

    from minillm.lab.bench import machine_record
    from minillm.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llms = {
        name: LLM("minillm-stdlib-target", dtype=args.dtype, speculative_config=spec)
        for name, spec in SYSTEMS.items()
    }
    workloads = {"code": CODE_PROMPTS, "repetitive": REPETITIVE_PROMPTS}
    record: dict = {
        **machine_record(),
        "target": "minillm-stdlib-target",
        "draft": "minillm-stdlib-draft",
        **weights_record("minillm-stdlib-target", "minillm-stdlib-draft"),
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "workloads": {},
    }
    for workload, prompts in workloads.items():
        for llm in llms.values():  # warm-up, and the outputs every system must agree on
            run_workload(llm, prompts[:1], 4)
        times: dict[str, list[float]] = {name: [] for name in llms}
        outputs: dict[str, list] = {}
        stats: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                before = _snapshot(llm)
                elapsed, outputs[name] = run_workload(llm, prompts, args.max_tokens)
                times[name].append(elapsed)
                after = llm.spec_decode_stats()
                if after is not None:
                    stats[name] = _delta(after, before)
        reference = outputs["target alone"]
        num_tokens = sum(len(o) for o in reference)
        base = statistics.median(times["target alone"])
        rows = {}
        print(f"\n{workload}: {len(prompts)} prompts one at a time, {num_tokens} tokens each run")
        print(
            f"{'system':<18} {'median s':>9} {'spread':>13} {'speed-up':>9} {'accept':>7} "
            f"{'tok/round':>9} {'predicted':>9}  per position"
        )
        for name in llms:
            median = statistics.median(times[name])
            row = {
                "times_s": times[name],
                "median_s": median,
                "min_s": min(times[name]),
                "max_s": max(times[name]),
                "tokens_per_s": num_tokens / median,
                "speedup": base / median,
                "same_output_as_target": outputs[name] == reference,
            }
            line = (
                f"{name:<18} {median:9.2f} {min(times[name]):6.2f}-{max(times[name]):<6.2f} "
                f"{base / median:8.2f}x"
            )
            if name in stats:
                k = SYSTEMS[name]["num_speculative_tokens"]
                row.update(stats_record(stats[name], k))
                per_pos = " ".join(f"{a:.2f}" for a in row["acceptance_rate_per_pos"])
                line += (
                    f" {row['acceptance_rate']:7.2f} {row['mean_acceptance_length']:9.2f} "
                    f"{row['predicted_tokens_per_round']:9.2f}  {per_pos}"
                )
            print(line)
            rows[name] = row
        record["workloads"][workload] = {"prompts": prompts, "systems": rows}
    return record


def _snapshot(llm):
    stats = llm.spec_decode_stats()
    if stats is None:
        return None
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            list(stats.num_accepted_tokens_per_pos), stats.num_emitted_tokens,
            stats.num_target_forwards)  # fmt: skip


def _delta(after, before):
    """The counters of one run: after minus before, as a SpecDecodingStats."""
    from minillm.spec.spec_runner import SpecDecodingStats

    drafts, draft_tokens, accepted, per_pos, emitted, forwards = before
    return SpecDecodingStats(
        num_speculative_tokens=after.num_speculative_tokens,
        num_drafts=after.num_drafts - drafts,
        num_draft_tokens=after.num_draft_tokens - draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - accepted,
        num_accepted_tokens_per_pos=[
            a - b for a, b in zip(after.num_accepted_tokens_per_pos, per_pos, strict=True)
        ],
        num_emitted_tokens=after.num_emitted_tokens - emitted,
        num_target_forwards=after.num_target_forwards - forwards,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the record to this file")
    args = parser.parse_args(argv)
    record = bench(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
