"""Batch invariance, measured: one prompt's logits alone and inside batches of other prompts.

`LogitsProbe` runs the engine and records the logits every sampling step hands the sampler,
per request, so that the rows of one prompt can be compared across runs that batch it with
different companions (batch size, order) and chunk it differently (`max_num_batched_tokens`,
the chunked-prefill budget). `measure_batch_invariance` tabulates, for each configuration,
the largest absolute difference from the prompt's logits alone and unchunked, and whether
they are bitwise equal. With `batch_invariant=False` it reports whatever the machine's kernels
do; with `batch_invariant=True` (`minillm.model.batch_invariant`) every row must be equal.

`batch_invariant_cost` measures the mode's price: the same generate() workload with the mode
off and on, interleaved over repeats, median and spread of each and their ratio. Run as
`python -m minillm.lab.batch_invariance` to record benchmarks/results/batch_invariance_cpu.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.bench import machine_record
from minillm.lab.kv_fp8_agreement import heldout_prompts
from minillm.lab.recorded import RESULTS_DIR, weights_record
from minillm.llm import LLM
from minillm.sampling_params import SamplingParams

MODEL = "minillm-stdlib-target"


class LogitsProbe:
    """Engines over one model (one per chunked-prefill budget, made on first use), whose
    sampled rows of logits are recorded. Prefix caching is off, so that every run computes
    its prompt in full."""

    def __init__(self, model: str = MODEL, batch_invariant: bool = False, **engine_args) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.engine_args = engine_args
        self.engines: dict[int | None, LLMEngine] = {}
        self.records: dict[str, list[torch.Tensor]] = {}
        self._ids = itertools.count()

    def engine(self, max_num_batched_tokens: int | None) -> LLMEngine:
        if max_num_batched_tokens not in self.engines:
            engine = LLMEngine(
                EngineArgs(
                    self.model,
                    batch_invariant=self.batch_invariant,
                    enable_prefix_caching=False,
                    max_num_batched_tokens=max_num_batched_tokens,
                    **self.engine_args,
                )
            )
            self._record_logits(engine)
            self.engines[max_num_batched_tokens] = engine
        return self.engines[max_num_batched_tokens]

    def _record_logits(self, engine: LLMEngine) -> None:
        runner = engine.model_runner
        sample = runner.sample

        def recording_sample(logits, rows, *args, **kwargs):
            for i, seqs in enumerate(rows):
                for seq in seqs:
                    self.records.setdefault(seq.request_id, []).append(logits[i].clone())
            return sample(logits, rows, *args, **kwargs)

        runner.sample = recording_sample

    def logits(
        self,
        prompt: list[int],
        companions: list[list[int]] = (),
        position: int = 0,
        max_num_batched_tokens: int | None = None,
        max_tokens: int = 4,
    ) -> torch.Tensor:
        """[max_tokens, vocab_size] float32: the logits of `prompt`'s greedy steps when it is
        queued at `position` among `companions` (all queued before the first step)."""
        engine = self.engine(max_num_batched_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        batch = list(companions)
        position = min(position, len(batch))
        batch.insert(position, prompt)
        ids = [f"probe-{next(self._ids)}" for _ in batch]
        for request_id, tokens in zip(ids, batch, strict=True):
            engine.add_request(request_id, tokens, params)
        while engine.has_unfinished_requests():
            engine.step()
        rows = self.records.pop(ids[position])
        for request_id in ids:
            self.records.pop(request_id, None)
        return torch.stack(rows)


@dataclass(frozen=True, slots=True)
class InvarianceRow:
    batch_size: int  # the prompt and batch_size - 1 companions, queued together
    max_num_batched_tokens: int | None  # the chunked-prefill budget; None: the default 2048
    max_abs_diff: float  # largest |logit difference| from the prompt alone, over all steps
    bitwise_equal: bool


def logits_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    """(max |a - b|, whether a and b are bitwise equal)."""
    return float((a - b).abs().max()), bool(torch.equal(a, b))


def measure_batch_invariance(
    model: str = MODEL,
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
    budgets: tuple[int | None, ...] = (None, 16, 7),
    batch_invariant: bool = False,
    prompt_len: int = 24,
    max_tokens: int = 4,
    **engine_args,
) -> list[InvarianceRow]:
    """One held-out prompt's logits in each (batch size, budget) configuration against the
    prompt alone with the default budget (no chunking): one row per configuration. The
    companions are the next held-out prompts, of the same length."""
    prompts = heldout_prompts(model, max(batch_sizes), prompt_len)
    probe = LogitsProbe(model, batch_invariant, **engine_args)
    alone = probe.logits(prompts[0], max_tokens=max_tokens)
    rows = []
    for budget in budgets:
        for batch_size in batch_sizes:
            got = probe.logits(prompts[0], prompts[1:batch_size], 0, budget, max_tokens)
            diff, equal = logits_difference(got, alone)
            rows.append(InvarianceRow(batch_size, budget, diff, equal))
    return rows


def batch_invariant_cost(
    model: str = MODEL,
    num_prompts: int = 8,
    prompt_len: int = 32,
    max_tokens: int = 16,
    repeats: int = 5,
    **engine_args,
) -> dict:
    """Seconds of one generate() of num_prompts greedy prompts with batch_invariant off and
    on, interleaved over `repeats` (the order alternates each repeat), after one warm-up each.
    Returns the times, each mode's median and min-max spread, and the ratio of medians."""
    prompts = [{"prompt_token_ids": p} for p in heldout_prompts(model, num_prompts, prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llms = {
        mode: LLM(model, batch_invariant=mode, enable_prefix_caching=False, **engine_args)
        for mode in (False, True)
    }
    times: dict[bool, list[float]] = {False: [], True: []}
    for llm in llms.values():
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    for repeat in range(repeats):
        for mode in (False, True) if repeat % 2 == 0 else (True, False):
            start = time.perf_counter()
            llms[mode].generate(prompts, params, use_tqdm=False)
            times[mode].append(time.perf_counter() - start)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    return {
        "off_s": times[False],
        "on_s": times[True],
        "median_off_s": median[False],
        "median_on_s": median[True],
        "spread_off_s": [min(times[False]), max(times[False])],
        "spread_on_s": [min(times[True]), max(times[True])],
        "ratio": median[True] / median[False],
        "workload": {
            "num_prompts": num_prompts,
            "prompt_tokens": prompt_len,
            "max_tokens": max_tokens,
            "repeats": repeats,
        },
    }


def record(dtype: str, repeats: int) -> dict:
    table = {
        ("on" if mode else "off"): [
            asdict(row) for row in measure_batch_invariance(batch_invariant=mode, dtype=dtype)
        ]
        for mode in (False, True)
    }
    return {
        **machine_record(),
        "model": MODEL,
        **weights_record(MODEL),
        "dtype": dtype,
        "attention_backend": "torch",
        "invariance": table,
        "cost": batch_invariant_cost(repeats=repeats, dtype=dtype),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=str(RESULTS_DIR / "batch_invariance_cpu.json"))
    args = parser.parse_args(argv)
    rec = record(args.dtype, args.repeats)
    for mode, rows in rec["invariance"].items():
        for row in rows:
            print(
                f"batch_invariant {mode:>3}: batch {row['batch_size']}, budget "
                f"{row['max_num_batched_tokens']}: max |diff| {row['max_abs_diff']:.3g}, "
                f"bitwise equal {row['bitwise_equal']}"
            )
    cost = rec["cost"]
    print(
        f"generate: off {cost['median_off_s']:.3f} s, on {cost['median_on_s']:.3f} s "
        f"(median of {len(cost['off_s'])}); the mode costs {cost['ratio']:.2f}x"
    )
    pathlib.Path(args.json).write_text(json.dumps(rec, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
